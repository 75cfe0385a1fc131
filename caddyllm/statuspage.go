package caddyllm

import (
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// statusFiles are the status page's HTML, CSS and JavaScript: all of it is
// served from the binary, nothing is fetched from elsewhere.
//
//go:embed statuspage
var statusFiles embed.FS

// statusPrefix is where the page lives, on the admin API and on a site.
const statusPrefix = "/llm_affinity/"

// statusPage is the page with its style and script inlined, and the
// Content-Security-Policy that allows exactly those two. They cannot be
// files of their own: a browser loads <script src> and stylesheets in
// no-cors mode, which Caddy's admin API refuses.
var statusPage, statusCSP = func() ([]byte, string) {
	read := func(name string) string {
		b, err := fs.ReadFile(statusFiles, "statuspage/"+name)
		if err != nil {
			panic(err)
		}
		return string(b)
	}
	style, script := read("status.css"), read("status.js")
	hash := func(s string) string {
		sum := sha256.Sum256([]byte(s))
		return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
	}
	page := strings.NewReplacer("{{STYLE}}", style, "{{SCRIPT}}", script).Replace(read("index.html"))
	csp := "default-src 'none'; connect-src 'self'; img-src data:; style-src " + hash(style) +
		"; script-src " + hash(script) + "; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
	return []byte(page), csp
}()

func init() {
	caddy.RegisterModule(StatusHandler{})
	httpcaddyfile.RegisterHandlerDirective("llm_affinity_status", parseStatusCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("llm_affinity_status", httpcaddyfile.Before, "respond")
}

// handleStatusPage serves the status page, GET /llm_affinity/. Its script
// fetches upstreams and drain relative to it, so they reach the same
// origin's /llm_affinity/upstreams endpoints.
func handleStatusPage(w http.ResponseWriter, r *http.Request) error {
	if r.URL.Path != statusPrefix {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no such page: %s", r.URL.Path)}
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		return methodNotAllowed(w, r, http.MethodGet, http.MethodHead)
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", statusCSP)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-cache")
	_, err := w.Write(statusPage)
	return err
}

// StatusHandler serves the status page, the upstreams, gateway and sync JSON and the drain
// endpoints on an ordinary site, under /llm_affinity/, exactly as the
// admin API does:
//
//	handle /llm_affinity/* {
//		llm_affinity_status
//	}
//
// Browsers cannot open the page on the admin listener itself: Caddy's
// admin API refuses any request that carries a Sec-Fetch-Mode header
// without an allowed Origin or Referer, and a browser's top-level
// navigation to a typed URL carries neither. A site can serve it; give
// the site the host name localhost and bind it there, or protect it
// (basic_auth, client certificates), since its buttons drain upstreams.
//
// Like the admin API, it refuses a request that changes state (POST,
// DELETE) unless its Origin names the site itself, so another web page
// cannot drain upstreams through a visitor's browser; and on a server
// listening on loopback addresses only it refuses any request whose Host
// is not a loopback name (a rebinding DNS name pointing at this machine
// would otherwise pass).
type StatusHandler struct{}

// CaddyModule returns the Caddy module information.
func (StatusHandler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.llm_affinity_status",
		New: func() caddy.Module { return new(StatusHandler) },
	}
}

// ServeHTTP implements caddyhttp.MiddlewareHandler.
func (StatusHandler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	err := checkHost(r)
	switch p := r.URL.Path; {
	case err != nil:
	case p == "/llm_affinity/upstreams":
		err = handleUpstreams(w, r)
	case p == "/llm_affinity/gateway":
		err = handleGateway(w, r)
	case p == "/llm_affinity/sync":
		err = handleSync(w, r)
	case strings.HasPrefix(p, "/llm_affinity/upstreams/"):
		if err = checkSameOrigin(r); err == nil {
			err = handleDrain(w, r)
		}
	default:
		err = handleStatusPage(w, r)
	}
	// Errors are answered as the admin API answers them, in JSON, so a
	// refused drain says why on either listener.
	var apiErr caddy.APIError
	if errors.As(err, &apiErr) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(apiErr.HTTPStatus)
		return json.NewEncoder(w).Encode(map[string]string{"error": apiErr.Err.Error()})
	}
	return err
}

// checkSameOrigin refuses a state-changing request from another origin:
// browsers send Origin with every POST and DELETE, and a request without
// one does not come from a web page.
func checkSameOrigin(r *http.Request) error {
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		return nil
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		if r.Header.Get("Sec-Fetch-Mode") != "" {
			return caddy.APIError{HTTPStatus: http.StatusForbidden, Err: fmt.Errorf("a browser request without Origin")}
		}
		return nil
	}
	u, err := url.Parse(origin)
	if err != nil || !strings.EqualFold(u.Host, r.Host) {
		return caddy.APIError{HTTPStatus: http.StatusForbidden, Err: fmt.Errorf("origin %q is not this site", origin)}
	}
	return nil
}

// checkHost refuses any request whose Host is not a loopback name on a
// server that listens on loopback addresses only, as Caddy's admin API
// refuses one: Origin and Host agree for a page on a name a rebinding
// DNS points at this machine, which could otherwise read the page's data
// and drain through it. (A server listening on other addresses too is
// reached by its public names, through local proxies and tunnels as
// well.)
func checkHost(r *http.Request) error {
	if srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok && listensOnLoopbackOnly(srv.Listen) && !isLoopbackHost(r.Host) {
		return caddy.APIError{HTTPStatus: http.StatusForbidden, Err: fmt.Errorf("host %q is not a loopback name, on a server listening on loopback only", r.Host)}
	}
	return nil
}

// listensOnLoopbackOnly says every one of a server's listen addresses is
// on a loopback interface (false for none, or one it cannot tell).
func listensOnLoopbackOnly(listen []string) bool {
	for _, addr := range listen {
		na, err := caddy.ParseNetworkAddress(addr)
		if err != nil || na.IsUnixNetwork() || na.IsFdNetwork() || na.Host == "" || !isLoopbackHost(na.Host) {
			return false
		}
	}
	return len(listen) > 0
}

// isLoopbackHost says a Host header names this machine's loopback:
// localhost or a loopback address, with or without a port.
func isLoopbackHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// parseStatusCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	llm_affinity_status
func parseStatusCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	var s StatusHandler
	return s, s.UnmarshalCaddyfile(h.Dispenser)
}

// UnmarshalCaddyfile implements caddyfile.Unmarshaler; the directive has
// no options.
func (*StatusHandler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if d.NextArg() || d.NextBlock(0) {
		return d.Err("llm_affinity_status takes no options")
	}
	return nil
}

// Interface guards
var (
	_ caddyhttp.MiddlewareHandler = StatusHandler{}
	_ caddyfile.Unmarshaler       = (*StatusHandler)(nil)
)
