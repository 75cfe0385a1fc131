package caddyllm

import (
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/url"
	"path"
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

func init() {
	caddy.RegisterModule(StatusHandler{})
	httpcaddyfile.RegisterHandlerDirective("llm_affinity_status", parseStatusCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("llm_affinity_status", httpcaddyfile.Before, "respond")
}

// handleStatusPage serves the status page (GET /llm_affinity/) and its
// static files (/llm_affinity/static/...). The page's scripts fetch
// upstreams and drain relative to it, so they reach the same origin's
// /llm_affinity/upstreams endpoints.
func handleStatusPage(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	rest, ok := strings.CutPrefix(r.URL.Path, statusPrefix)
	if !ok {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("not found")}
	}
	name := "index.html"
	if rest != "" {
		static, ok := strings.CutPrefix(rest, "static/")
		if !ok || static == "" || path.Clean(static) != static || strings.Contains(static, "/") {
			return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no such page: %s", r.URL.Path)}
		}
		name = static
	}
	b, err := fs.ReadFile(statusFiles, "statuspage/"+name)
	if err != nil || name == "index.html" && rest != "" {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no such page: %s", r.URL.Path)}
	}
	h := w.Header()
	switch path.Ext(name) {
	case ".html":
		h.Set("Content-Type", "text/html; charset=utf-8")
	case ".css":
		h.Set("Content-Type", "text/css; charset=utf-8")
	case ".js":
		h.Set("Content-Type", "text/javascript; charset=utf-8")
	}
	// The page runs only its own files; it must not be framed elsewhere.
	h.Set("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-cache")
	_, err = w.Write(b)
	return err
}

// StatusHandler serves the status page, the upstreams JSON and the drain
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
// navigation to a typed URL carries neither. A site can serve it; bind
// that site to localhost, or protect it (basic_auth, client
// certificates), since its buttons drain upstreams.
//
// Like the admin API, it refuses a request that changes state (POST,
// DELETE) unless its Origin names the site itself, so another web page
// cannot drain upstreams through a visitor's browser.
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
	var err error
	switch p := r.URL.Path; {
	case p == "/llm_affinity/upstreams":
		err = handleUpstreams(w, r)
	case strings.HasPrefix(p, "/llm_affinity/upstreams/"):
		if err = checkSameOrigin(r); err == nil {
			err = handleDrain(w, r)
		}
	default:
		err = handleStatusPage(w, r)
	}
	var apiErr caddy.APIError
	if errors.As(err, &apiErr) {
		return caddyhttp.Error(apiErr.HTTPStatus, apiErr.Err)
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
