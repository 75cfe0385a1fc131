package llmbench

import (
	_ "unsafe" // for go:linkname

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// countRequest is Caddy's own (*reverseproxy.Host).countRequest, which its proxy calls as a
// request starts (+1) and ends (-1) on an upstream, and which least_conn reads back through
// Upstream.NumRequests. It is not exported; the simulation calls it so that Caddy's
// least_conn sees the requests in flight on each replica exactly as it would behind a real
// reverse_proxy. TestCaddyRequestCounts fails if Caddy renames it.
//
//go:linkname countRequest github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy.(*Host).countRequest
func countRequest(h *reverseproxy.Host, delta int) error
