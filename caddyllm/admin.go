package caddyllm

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/fleetsync"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the live routing state and drain control on Caddy's
// admin endpoint:
//
//	GET    /llm_affinity/                            the status page (HTML)
//	GET    /llm_affinity/upstreams                   every upstream's state
//	POST   /llm_affinity/upstreams/{dial}/drain      drain; deadline in ?deadline=30s or {"deadline":"30s"}
//	DELETE /llm_affinity/upstreams/{dial}/drain      undrain
//	GET    /llm_affinity/sync                        the sync option's connections and peers
//
// With the sync option, drains and undrains made here reach the peer
// routers too.
//
// It is a thin view over the state the loaded policies share (see pool):
// Caddy re-creates admin modules on every config load and never cleans
// them up, so they hold no reference of their own. A drain's default
// deadline is the longest drain_deadline of the policies naming the
// upstream.
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
		{Pattern: "/llm_affinity/sync", Handler: caddy.AdminHandlerFunc(handleSync)},
		{Pattern: "/llm_affinity/gateway", Handler: caddy.AdminHandlerFunc(handleGateway)},
		{Pattern: statusPrefix, Handler: caddy.AdminHandlerFunc(handleStatusPage)},
	}
}

func handleUpstreams(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return methodNotAllowed(w, r, http.MethodGet)
	}
	ups := []UpstreamSnapshot{} // [] rather than null while no policy is loaded
	if sh := lookupShared(); sh != nil {
		sh.startSites("") // the view shows the running config's drains and capacities
		ups = sh.snapshot()
	}
	slices.SortFunc(ups, func(a, b UpstreamSnapshot) int { return strings.Compare(a.Dial, b.Dial) })
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(ups)
}

// GatewayView is the admin API's view of the requests held at the
// gateway.
type GatewayView struct {
	// Held is how many requests wait for an upstream that can start them.
	Held int `json:"held"`
}

func handleGateway(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return methodNotAllowed(w, r, http.MethodGet)
	}
	var v GatewayView
	if sh := lookupShared(); sh != nil {
		v.Held = sh.fleet.Held()
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

func handleDrain(w http.ResponseWriter, r *http.Request) error {
	// Split the path as sent, so that a dial holding slashes (a unix
	// socket, unix//run/engine.sock) can be given escaped (%2F).
	rest := strings.TrimPrefix(r.URL.EscapedPath(), "/llm_affinity/upstreams/")
	escaped, ok := strings.CutSuffix(rest, "/drain")
	dial, err := url.PathUnescape(escaped)
	if !ok || err != nil || dial == "" || strings.Contains(escaped, "/") {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("want /llm_affinity/upstreams/{dial}/drain (a dial with slashes escaped as %%2F)")}
	}
	if r.Method != http.MethodPost && r.Method != http.MethodDelete {
		return methodNotAllowed(w, r, http.MethodPost, http.MethodDelete)
	}
	sh := lookupShared()
	if sh == nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no llm_affinity policy is loaded")}
	}
	sh.startSites("")
	if r.Method == http.MethodPost {
		if !sh.fleet.Routable(dial) {
			// A typo would otherwise sit in the admin view as a drained
			// upstream that nothing routes to.
			return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no loaded llm_affinity policy has upstream %s", dial)}
		}
		deadline, err := drainDeadlineOf(r, sh.adminDrainDeadline(dial))
		if err != nil {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
		}
		sh.fleetOp(dial, true, deadline) // kept for the fleet only while syncing
		sh.publish(fleetsync.Message{Drain: dial, Deadline: deadline})
	} else {
		// An upstream the admin API drained stays undrainable after no
		// config names it any more, and so does one the fleet holds
		// drained; anything else unknown is a typo.
		if !sh.fleet.Routable(dial) && !sh.drains.HeldBy(dial, drain.ByAdmin) && !sh.heldByFleet(dial) {
			return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no loaded llm_affinity policy has upstream %s", dial)}
		}
		sh.drains.Undrain(dial, drain.Admin)
		sh.fleetOp(dial, false, 0)
		sh.publish(fleetsync.Message{Undrain: dial})
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(map[string]string{"dial": dial, "drain": sh.drains.Phase(dial).String()})
}

// methodNotAllowed answers 405 with the Allow header naming the methods
// the endpoint takes.
func methodNotAllowed(w http.ResponseWriter, r *http.Request, allowed ...string) error {
	w.Header().Set("Allow", strings.Join(allowed, ", "))
	return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed,
		Err: fmt.Errorf("method %s not allowed; use %s", r.Method, strings.Join(allowed, " or "))}
}

// drainBodyDeadline reads a drain request's body, one JSON object whose
// only member is deadline, a string, given once and named so exactly
// (encoding/json would take the last of two, and "Deadline" for it);
// given says it had one. An empty chunked body has none.
func drainBodyDeadline(body io.Reader, chunked bool) (deadline string, given bool, err error) {
	const want = `want a JSON object such as {"deadline":"30s"}`
	fail := func(format string, args ...any) (string, bool, error) {
		return "", false, fmt.Errorf("reading drain request body: "+format, args...)
	}
	dec := json.NewDecoder(body)
	dec.UseNumber() // a number out of float64's range is no error of Go's types
	tok, err := dec.Token()
	switch {
	case err == io.EOF && chunked:
		return "", false, nil
	case err != nil:
		return fail("%v", err)
	case tok != json.Delim('{'):
		return fail(want)
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return fail("%v", err)
		}
		if key, _ := tok.(string); key != "deadline" {
			return fail("unknown field %q: the only one is deadline", key)
		}
		if given {
			return fail("deadline given twice")
		}
		if tok, err = dec.Token(); err != nil {
			return fail("%v", err)
		}
		var ok bool
		if deadline, ok = tok.(string); !ok {
			return fail(want + ", with deadline a string")
		}
		given = true
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return fail("%v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return fail("more than one JSON object")
	}
	return deadline, given, nil
}

// drainDeadlineOf reads the deadline from the query (?deadline=30s) or a
// JSON body ({"deadline":"30s"}); without one it is byDefault. Anything
// it does not understand is refused: a misspelt or doubled deadline must
// not drain with another one.
func drainDeadlineOf(r *http.Request, byDefault time.Duration) (time.Duration, error) {
	query := r.URL.Query()
	for key, vals := range query {
		if key != "deadline" {
			return 0, fmt.Errorf("unknown query parameter %q: the only one is deadline", key)
		}
		if len(vals) > 1 {
			return 0, fmt.Errorf("deadline given %d times", len(vals))
		}
	}
	raw, given := query.Get("deadline"), query.Has("deadline")
	if r.Body != nil && r.ContentLength != 0 {
		deadline, inBody, err := drainBodyDeadline(http.MaxBytesReader(nil, r.Body, 4096), r.ContentLength < 0)
		if err != nil {
			return 0, err
		}
		if inBody {
			if given {
				return 0, fmt.Errorf("deadline given in both the query and the body")
			}
			raw, given = deadline, true
		}
	}
	if !given {
		return byDefault, nil
	}
	d, err := caddy.ParseDuration(raw)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("invalid deadline %q", raw)
	}
	return d, nil
}

// Interface guards
var _ caddy.AdminRouter = (*adminAPI)(nil)
