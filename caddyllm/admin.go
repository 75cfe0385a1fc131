package caddyllm

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the live routing state and drain control on Caddy's
// admin endpoint:
//
//	GET    /llm_affinity/upstreams                   every upstream's state
//	POST   /llm_affinity/upstreams/{dial}/drain      drain; deadline in ?deadline=30s or {"deadline":"30s"}
//	DELETE /llm_affinity/upstreams/{dial}/drain      undrain
//
// It is a thin view over package-level state: Caddy re-creates admin
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
	return []caddy.AdminRoute{
		{Pattern: "/llm_affinity/upstreams", Handler: caddy.AdminHandlerFunc(handleUpstreams)},
		{Pattern: "/llm_affinity/upstreams/", Handler: caddy.AdminHandlerFunc(handleDrain)},
	}
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

func handleDrain(w http.ResponseWriter, r *http.Request) error {
	rest := strings.TrimPrefix(r.URL.Path, "/llm_affinity/upstreams/")
	dial, ok := strings.CutSuffix(rest, "/drain")
	if !ok || dial == "" || strings.Contains(dial, "/") {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("want /llm_affinity/upstreams/{dial}/drain")}
	}
	switch r.Method {
	case http.MethodPost:
		deadline, err := drainDeadlineOf(r)
		if err != nil {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
		}
		drains.Drain(dial, deadline, drain.ByAdmin)
	case http.MethodDelete:
		drains.Undrain(dial, drain.ByAdmin)
	default:
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed; use POST or DELETE", r.Method)}
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(map[string]string{"dial": dial, "drain": drains.Phase(dial).String()})
}

// drainDeadlineOf reads the deadline from the query or a JSON body.
func drainDeadlineOf(r *http.Request) (time.Duration, error) {
	raw := r.URL.Query().Get("deadline")
	if raw == "" && r.Body != nil && r.ContentLength != 0 {
		var body struct {
			Deadline string `json:"deadline"`
		}
		if err := json.NewDecoder(http.MaxBytesReader(nil, r.Body, 4096)).Decode(&body); err != nil {
			return 0, fmt.Errorf("reading drain request body: %v", err)
		}
		raw = body.Deadline
	}
	if raw == "" {
		return time.Duration(adminDrainDeadline.Load()), nil
	}
	d, err := caddy.ParseDuration(raw)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("invalid deadline %q", raw)
	}
	return d, nil
}

// Interface guards
var _ caddy.AdminRouter = (*adminAPI)(nil)
