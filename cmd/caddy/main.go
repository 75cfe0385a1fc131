// Command caddy is Caddy with the llm_affinity plugin and the kvsim
// simulated inference engine compiled in, as xcaddy would build it.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	// The module root registers the plugin's modules, as xcaddy's build does.
	_ "github.com/llmaffinity/caddy-llm-affinity"
)

func main() {
	caddycmd.Main()
}
