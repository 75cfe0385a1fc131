package caddyllm

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the live routing state on Caddy's admin endpoint:
//
//	GET /llm_affinity/upstreams
//
// It is a thin view over the package-level fleet: Caddy re-creates admin
// modules on every config load and never cleans them up.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.llm_affinity",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes implements caddy.AdminRouter.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{
		Pattern: "/llm_affinity/upstreams",
		Handler: caddy.AdminHandlerFunc(handleUpstreams),
	}}
}

func handleUpstreams(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	ups := snapshotUpstreams()
	slices.SortFunc(ups, func(a, b UpstreamSnapshot) int { return strings.Compare(a.Dial, b.Dial) })
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(ups)
}

// Interface guards
var _ caddy.AdminRouter = (*adminAPI)(nil)
