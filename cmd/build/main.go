// Command build compiles a Caddy binary from xcaddy.json: the pinned Caddy version, the
// plugins and the module replacements, in the field names of xcaddy's Builder. It runs
// xcaddy's own Go package (github.com/caddyserver/xcaddy), so the result is what
// `xcaddy build` makes: a temporary main module importing Caddy, its standard modules and each
// plugin, built with -trimpath and stripped symbols.
//
// Relative replacement paths in xcaddy.json are resolved against the directory that holds
// xcaddy.json, so the entry {"old": "github.com/llmaffinity/caddy-llm-affinity", "new": "."}
// builds this checkout. The module path is not published, so the module proxy must never be
// asked for it:
//
//   - The plugin entry for the module root carries a placeholder version, v0.0.0, which
//     `go get` resolves through the replacement; without a version it would ask the proxy
//     for the latest one.
//   - The replacement has no version, so it covers every package path inside the module, and
//     xcaddy runs no `go get` for a plugin under a replaced path: that is what lets
//     xcaddy.json list kvsim's Caddy module, .../kvsim/caddykvsim, as a plugin of its own
//     (the root package leaves it out of production builds).
//
// Usage, from anywhere inside the checkout:
//
//	go run ./cmd/build -o caddy
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"time"

	"github.com/caddyserver/xcaddy"
)

// manifestName is the file name looked up from the working directory upwards.
const manifestName = "xcaddy.json"

func main() {
	log.SetFlags(0)
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		log.Fatalf("build: %v", err)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("build", flag.ContinueOnError)
	fs.SetOutput(stderr)
	output := fs.String("o", "caddy", "write the Caddy binary to this `file`")
	manifest := fs.String("config", "", "the xcaddy.json `file` to build from (default: "+manifestName+
		" in the working directory or the nearest parent that has one)")
	goos := fs.String("goos", "", "target operating system (default: $GOOS, else this machine's)")
	goarch := fs.String("goarch", "", "target architecture (default: $GOARCH, else this machine's)")
	race := fs.Bool("race", false, "build with the race detector (enables cgo)")
	skipCleanup := fs.Bool("skip-cleanup", false, "keep the temporary build module and print its folder")
	printOnly := fs.Bool("print", false, "print the resolved build (xcaddy Builder JSON) and exit without building")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `Usage: go run ./cmd/build [flags]

Builds Caddy with the plugins listed in xcaddy.json, using xcaddy's Builder
(github.com/caddyserver/xcaddy). xcaddy.json uses the JSON field names of
xcaddy.Builder: caddy_version, plugins [{module_path, version}],
replacements [{old, new}]; relative "new" paths are resolved against the
directory holding xcaddy.json, so "." means this checkout.

Needs only Go and the Go module proxy. The first build compiles Caddy and
its dependencies (5m28s measured on two cores, see the README); later builds
about 22s.

Flags:
`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}

	path := *manifest
	if path == "" {
		found, err := findManifest(".")
		if err != nil {
			return err
		}
		path = found
	}
	b, err := loadBuilder(path)
	if err != nil {
		return err
	}
	if *goos != "" {
		b.OS = *goos
	}
	if *goarch != "" {
		b.Arch = *goarch
	}
	b.RaceDetector = b.RaceDetector || *race
	b.SkipCleanup = b.SkipCleanup || *skipCleanup

	if *printOnly {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "\t")
		return enc.Encode(b)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	start := time.Now()
	if err := b.Build(ctx, *output); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "built %s (Caddy %s, %s) in %s\n", *output, b.CaddyVersion,
		pluginList(b.Plugins), time.Since(start).Round(100*time.Millisecond))
	return nil
}

// findManifest returns the path of xcaddy.json in dir or its nearest parent that has one.
func findManifest(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	for d := abs; ; {
		p := filepath.Join(d, manifestName)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		parent := filepath.Dir(d)
		if parent == d {
			return "", fmt.Errorf("no %s in %s or any parent directory; pass -config", manifestName, abs)
		}
		d = parent
	}
}

// loadBuilder reads an xcaddy.json. Unknown fields are an error, so a misspelt field cannot
// silently drop a plugin or a pin. Relative replacement paths become absolute paths under the
// manifest's directory, because xcaddy builds in a temporary directory elsewhere.
func loadBuilder(path string) (xcaddy.Builder, error) {
	var b xcaddy.Builder
	data, err := os.ReadFile(path)
	if err != nil {
		return b, err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&b); err != nil {
		return b, fmt.Errorf("%s: %w", path, err)
	}
	if dec.More() {
		return b, fmt.Errorf("%s: trailing data after the JSON object", path)
	}
	if b.CaddyVersion == "" {
		return b, fmt.Errorf("%s: caddy_version is required (pin a release, e.g. v2.11.9)", path)
	}
	for i, p := range b.Plugins {
		if p.PackagePath == "" {
			return b, fmt.Errorf("%s: plugins[%d]: module_path is required", path, i)
		}
	}
	base, err := filepath.Abs(filepath.Dir(path))
	if err != nil {
		return b, err
	}
	for i, r := range b.Replacements {
		if r.Old == "" || r.New == "" {
			return b, fmt.Errorf("%s: replacements[%d]: old and new are required", path, i)
		}
		if isLocalPath(string(r.New)) {
			b.Replacements[i].New = xcaddy.ReplacementPath(filepath.Join(base, string(r.New)))
		}
	}
	return b, nil
}

// isLocalPath reports whether a replacement target is a relative directory, as opposed to an
// absolute directory or a module path with a version. Go treats a replacement as a directory
// when it starts with ./ or ../ (or is . or ..).
func isLocalPath(p string) bool {
	return p == "." || p == ".." || strings.HasPrefix(p, "./") || strings.HasPrefix(p, "../")
}

func pluginList(ps []xcaddy.Dependency) string {
	if len(ps) == 0 {
		return "no plugins"
	}
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.String()
	}
	return strings.Join(names, ", ")
}
