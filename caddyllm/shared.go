package caddyllm

import (
	"context"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/fleetsync"
	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// pool holds the state every loaded llm_affinity policy shares, the way
// Caddy's reverse proxy shares its hosts: reference-counted, created by the
// first Provision and destroyed by the last Cleanup. Caddy provisions a new
// config before it cleans up the old one, so the state survives reloads.
//
// It holds the shared host (sharedKey) and one entry per upstream that a
// loaded config names (namedKey): when the last config naming an upstream
// is unloaded, its routing and drain state go.
var pool = caddy.NewUsagePool()

// sharedKey is the pool key of the shared host.
const sharedKey = "llm_affinity"

// namedKey is the pool key of an upstream named by a loaded config.
type namedKey string

// idleExpiry is how long an upstream no config names (a dynamic one) keeps
// its state once idle.
const idleExpiry = time.Hour

// shared is the routing state of the process: the fleet (by dial address),
// the drain registry, the metrics, the live scrapers and the loaded sites.
type shared struct {
	fleet   *router.Fleet
	drains  *drain.Registry
	metrics *metrics
	logger  *zap.Logger
	stop    chan struct{}
	// instance names this routing state on the sync connections, so that
	// two of them never apply each other's events.
	instance uint64

	// syncers are the NATS connections of the sync option, read by the
	// fleet's publisher without a lock; written under mu.
	syncers atomic.Pointer[[]*fleetsync.Syncer]

	mu sync.Mutex
	// closingSyncers are connections no config uses any more, closing;
	// closedSync sums the counters of those closed. Under mu, so that the
	// metrics find each connection in exactly one place (in use, closing,
	// closed) and their counters never go down on a reload.
	closingSyncers []*fleetsync.Syncer
	closedSync     syncTotals
	// syncLoads names, for each connection in use, the config load that
	// last acquired it (see retireReplaced).
	syncLoads map[*fleetsync.Syncer]context.Context
	sites     map[string]*site
	// pendingSites counts the sites whose config has not run yet, so
	// that the admin API and the metrics skip startSites' lock when
	// there are none.
	pendingSites atomic.Int32
	scrapers     map[*scrape.Scraper]bool
	// foreignBlockTokens are the peers' block sizes warned of (see
	// warnForeignBlocks).
	foreignBlockTokens []int
	nextSite           uint64
	// fleetDrains are the operators' drains in force across the routers
	// sharing a view, by upstream, with their deadlines: those heard from
	// peers and, while this router syncs, its own, until an undrain. An
	// upstream a config names again after dropping it takes its drain back
	// from here (see nameUpstreams): the fleet's other routers still hold
	// it. At most maxFleetDrains.
	fleetDrains map[string]time.Time
}

// maxFleetDrains bounds shared.fleetDrains: upstreams a fleet drains at
// once.
const maxFleetDrains = 1024

// site is one provisioned policy: the owner of its config and health
// drains, and the upstreams it names.
type site struct {
	drainDeadline time.Duration
	dials         []string
	// kvCapacity is the KV capacity the site configures for each of its
	// dials, where it configures one; scrapes says it reads its engines'
	// signals, whose own figure wins once known.
	kvCapacity map[string]int
	scrapes    bool
	// dynamic says the site's proxy has dynamic upstreams, which no
	// config names: defaultKV, its kv_capacity for any upstream it has
	// no profile for, is theirs.
	dynamic   bool
	defaultKV int
	// running says the site's config runs: only then do its drains and
	// capacities take effect (a config Caddy rejects must not drain, cut
	// or resize anything). It runs once the running config differs from
	// before, the one running when it was provisioned, or once it serves
	// a request. pending are its drains not in force yet.
	running bool
	before  context.Context
	pending []string
}

// acquireShared returns the shared host, creating it; each call must be
// matched by a releaseShared.
func acquireShared() *shared {
	v, _, _ := pool.LoadOrNew(sharedKey, func() (caddy.Destructor, error) { return newShared(), nil })
	return v.(*shared)
}

func releaseShared() { pool.Delete(sharedKey) }

// lookupShared returns the shared host if any policy is loaded, for the
// admin API (whose modules Caddy never cleans up, so they hold no
// reference).
func lookupShared() *shared {
	var sh *shared
	pool.Range(func(k, v any) bool {
		if k == sharedKey {
			sh = v.(*shared)
			return false
		}
		return true
	})
	return sh
}

func newShared() *shared {
	sh := &shared{
		fleet:    router.New(),
		logger:   caddy.Log().Named("llm_affinity"),
		stop:     make(chan struct{}),
		instance: rand.Uint64() | 1,
		sites:    make(map[string]*site),
		scrapers: make(map[*scrape.Scraper]bool),
	}
	sh.metrics = newMetrics(sh)
	sh.drains = drain.New(sh.drainEvents())
	go sh.janitor()
	return sh
}

// Destruct stops the janitor; the last policy is gone.
func (sh *shared) Destruct() error {
	close(sh.stop)
	return nil
}

// janitor releases the charges of silent peers (every second, whether or
// not a sync connection is still loaded: a reload that drops the sync
// option must not leave peers' charges behind) and forgets idle dynamic
// upstreams, until the host is destroyed.
func (sh *shared) janitor() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	lastExpiry := time.Now()
	for {
		select {
		case <-sh.stop:
			return
		case now := <-t.C:
			sh.fleet.ExpirePeers(now, now.Add(-peerSilence), now.Add(-peerChargeLife))
			if now.Sub(lastExpiry) >= time.Minute {
				sh.expireIdle(now.Add(-idleExpiry))
				lastExpiry = now
			}
		}
	}
}

// expireIdle forgets the dynamic upstreams idle since before cutoff, and
// with them any drain an operator or a peer put on them and their scrape
// targets: nothing routes there any more, and the admin view would keep
// them for ever.
func (sh *shared) expireIdle(cutoff time.Time) {
	dropped := sh.fleet.Expire(cutoff)
	for _, dial := range dropped {
		sh.drains.Forget(dial)
	}
	if len(dropped) > 0 {
		// Nor are they scraped any more (a request that routes there
		// again adds them back).
		for _, s := range sh.liveScrapers() {
			s.RemoveTargets(dropped...)
		}
	}
}

// addSite registers s, a provisioned policy's site, provisioned while
// the config before ran, and returns its owner name.
func (sh *shared) addSite(s *site, before context.Context) string {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.nextSite++
	owner := "site-" + strconv.FormatUint(sh.nextSite, 10)
	s.running, s.before, s.pending = false, before, nil
	sh.sites[owner] = s
	sh.pendingSites.Add(1)
	return owner
}

// configuredKVOf is the largest KV capacity the running sites configure
// for dial (kv_capacity; 0 for none) and whether any of them names it
// (or, for an upstream none names, has dynamic upstreams).
func (sh *shared) configuredKVOf(dial string) (kv int, named bool) {
	sh.startSites("") // the config that replaced another runs
	dynamic := sh.fleet.IsDynamic(dial)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	kv, _, named = sh.configuredLocked(dial, dynamic)
	return kv, named
}

// configuredLocked is the largest KV capacity the running sites configure
// for dial (kv_capacity; 0 for none), whether one of those naming it
// scrapes it, and whether any names it. A dynamic upstream (no loaded
// config names it: router.Fleet.IsDynamic) takes the kv_capacity the
// running sites with dynamic upstreams give any upstream. Caller holds
// sh.mu.
func (sh *shared) configuredLocked(dial string, dynamic bool) (kv int, scraped, named bool) {
	for _, s := range sh.sites {
		if s.running && (slices.Contains(s.dials, dial) || dynamic && s.dynamic) {
			n := s.kvCapacity[dial]
			if !slices.Contains(s.dials, dial) {
				n = s.defaultKV
			}
			kv, scraped, named = max(kv, n), scraped || s.scrapes, true
		}
	}
	return kv, scraped, named
}

// configuredKV is the largest KV capacity a running site configures for
// each dial (kv_capacity), for the admin view of upstreams not routed to
// yet.
func (sh *shared) configuredKV() map[string]int {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	out := make(map[string]int)
	for _, s := range sh.sites {
		if !s.running {
			continue
		}
		for dial, n := range s.kvCapacity {
			out[dial] = max(out[dial], n)
		}
	}
	return out
}

// configureLocked gives each of s's upstreams the KV capacity the
// running sites configure (see router.Fleet.Configure), so that a reload
// resizes the index, and shows in the admin view, at once: those s
// names, and the dynamic ones when s has dynamic upstreams. Caller holds
// sh.mu.
func (sh *shared) configureLocked(s *site) {
	now := time.Now()
	configure := func(dials []string, dynamic bool) {
		for _, dial := range dials {
			if kv, scraped, named := sh.configuredLocked(dial, dynamic); named {
				sh.fleet.Configure(dial, kv, scraped, now)
			}
		}
	}
	configure(s.dials, false)
	if s.dynamic {
		configure(sh.fleet.Dynamic(), true)
	}
}

// deferDrains records drains of owner's config that take effect once the
// config runs.
func (sh *shared) deferDrains(owner string, dials []string) {
	if len(dials) == 0 {
		return
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if s := sh.sites[owner]; s != nil {
		s.pending = dials
	}
}

// startSites puts in force what the sites whose config runs now, and
// owner's (it serves requests, so it runs), configure: their deferred
// drains and their upstreams' KV capacities. The routing path, the admin
// API and the metrics call it, whichever notices first; it costs an
// atomic load when every site runs.
func (sh *shared) startSites(owner string) {
	if sh.pendingSites.Load() == 0 {
		return
	}
	running := caddy.ActiveContext().Context
	sh.mu.Lock()
	defer sh.mu.Unlock() // held while draining, so removeSite cannot come between
	for name, s := range sh.sites {
		if s.running || (name != owner && running == s.before) {
			continue
		}
		for _, dial := range s.pending {
			sh.drains.Drain(dial, s.drainDeadline, drain.Hold{Cause: drain.ByConfig, Owner: name})
		}
		s.running, s.pending, s.before = true, nil, nil
		sh.pendingSites.Add(-1)
		sh.configureLocked(s)
	}
}

// removeSite forgets owner's site: its drains are lifted, and the
// upstreams the running sites still name take their figures.
func (sh *shared) removeSite(owner string) {
	sh.mu.Lock()
	if s := sh.sites[owner]; s != nil {
		delete(sh.sites, owner)
		if s.running {
			sh.configureLocked(s) // a figure the reload lowered, say
		} else {
			sh.pendingSites.Add(-1)
		}
	}
	sh.mu.Unlock()
	sh.drains.ReleaseOwner(owner)
}

// adminDrainDeadline is the deadline of an admin drain of dial that gives
// none: the longest drain_deadline of the sites naming dial (or of all
// sites, when none names it), so no site's requests are cut sooner than
// its config allows.
func (sh *shared) adminDrainDeadline(dial string) time.Duration {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	var naming, anySite time.Duration
	for _, s := range sh.sites {
		anySite = max(anySite, s.drainDeadline)
		if slices.Contains(s.dials, dial) {
			naming = max(naming, s.drainDeadline)
		}
	}
	switch {
	case naming > 0:
		return naming
	case anySite > 0:
		return anySite
	}
	return defaultDrainDeadline
}

// nameUpstreams takes a reference on each of dials for a config naming
// them; releaseUpstreams gives them back.
func (sh *shared) nameUpstreams(dials []string) {
	now := time.Now()
	for _, d := range dials {
		_, loaded, _ := pool.LoadOrNew(namedKey(d), func() (caddy.Destructor, error) { return &namedUpstream{dial: d, sh: sh}, nil })
		sh.fleet.Name(d, now)
		sh.metrics.name(d)
		if !loaded {
			// Named again after no config named it (its drains were
			// lifted then): an operator's drain the fleet still holds
			// holds here too. Under mu, so that a peer's undrain comes
			// wholly before or after (see fleetOp).
			sh.mu.Lock()
			if until, ok := sh.fleetDrains[d]; ok {
				sh.drains.Drain(d, max(0, until.Sub(now)), drain.Admin)
			}
			sh.mu.Unlock()
		}
	}
}

// fleetOp applies an operator's drain of dial (on) with deadline, or its
// undrain, made through a peer or through this router: while it syncs, it
// is recorded (see fleetDrains); on an upstream this router routes to, it is
// held or lifted (an undrain lifts the operators' hold only: this
// router's own config and health holds are its own). One lock over both,
// so that a config naming the upstream again at that moment
// (nameUpstreams) sees the fleet's drain and holds it, or sees it gone.
func (sh *shared) fleetOp(dial string, on bool, deadline time.Duration) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	// A closing connection's last batch may come after the last one was
	// removed: no record then, which no undrain could reach.
	if !on || len(sh.loadSyncers()) > 0 {
		sh.noteFleetDrainLocked(dial, on, deadline)
	}
	if !sh.fleet.Routable(dial) {
		return
	}
	if on {
		sh.drains.Drain(dial, deadline, drain.Admin)
	} else {
		sh.drains.Lift(dial, drain.Admin)
	}
}

// noteFleetDrainLocked records an operator's drain of dial (on) until
// deadline from now, or its undrain (see fleetDrains). A second drain
// keeps the earlier deadline, as the drain registry does. When the record
// is full, the drain whose deadline passed longest ago makes room: the
// likeliest to be of an upstream gone for good. Caller holds sh.mu.
func (sh *shared) noteFleetDrainLocked(dial string, on bool, deadline time.Duration) {
	if !on {
		delete(sh.fleetDrains, dial)
		return
	}
	until := time.Now().Add(max(0, deadline))
	if sh.fleetDrains == nil {
		sh.fleetDrains = make(map[string]time.Time)
	}
	if old, ok := sh.fleetDrains[dial]; ok {
		sh.fleetDrains[dial] = minTime(old, until)
		return
	}
	if len(sh.fleetDrains) >= maxFleetDrains {
		oldest, at := "", time.Time{}
		for d, t := range sh.fleetDrains {
			if oldest == "" || t.Before(at) {
				oldest, at = d, t
			}
		}
		delete(sh.fleetDrains, oldest)
	}
	sh.fleetDrains[dial] = until
}

// fleetDrainDials lists the upstreams of the fleet's drains this router
// keeps (see fleetDrains), for the admin view.
func (sh *shared) fleetDrainDials() []string {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return append([]string{}, slices.Sorted(maps.Keys(sh.fleetDrains))...)
}

// heldByFleet says the fleet's operators hold dial drained, as far as
// this router heard.
func (sh *shared) heldByFleet(dial string) bool {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	_, ok := sh.fleetDrains[dial]
	return ok
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func releaseUpstreams(dials []string) {
	for _, d := range dials {
		pool.Delete(namedKey(d))
	}
}

// namedUpstream is the pool entry of an upstream a loaded config names.
type namedUpstream struct {
	dial string
	sh   *shared
}

// Destruct forgets the upstream: the last config naming it is unloaded.
// Its routing state goes once nothing is in flight there, every drain on
// it is lifted (nothing can route to it any more) and its metric series
// are deleted.
func (n *namedUpstream) Destruct() error {
	n.sh.fleet.Forget(n.dial)
	n.sh.drains.Forget(n.dial)
	n.sh.metrics.forget(n.dial)
	return nil
}

func (sh *shared) addScraper(s *scrape.Scraper) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.scrapers[s] = true
}

// inheritScrapes gives a new config's scraper what the loaded configs'
// scrapers saw of its upstreams (see scrape.Scraper.Inherit).
func (sh *shared) inheritScrapes(s *scrape.Scraper) {
	for _, from := range sh.liveScrapers() {
		s.Inherit(from)
	}
}

func (sh *shared) removeScraper(s *scrape.Scraper) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	delete(sh.scrapers, s)
}

// liveScrapers lists the scrapers of the loaded configs.
func (sh *shared) liveScrapers() []*scrape.Scraper {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	out := make([]*scrape.Scraper, 0, len(sh.scrapers))
	for s := range sh.scrapers {
		out = append(out, s)
	}
	return out
}

// drainEvents logs and counts drain transitions.
func (sh *shared) drainEvents() drain.Events {
	logger := sh.logger.Named("drain")
	return drain.Events{
		Draining: func(dial string, cause drain.Cause, deadline time.Duration) {
			sh.metrics.drainTransitions.WithLabelValues("draining").Inc()
			logger.Info("upstream draining", zap.String("upstream", dial),
				zap.String("cause", string(cause)), zap.Duration("deadline", deadline))
		},
		Undrained: func(dial string, cause drain.Cause) {
			sh.metrics.drainTransitions.WithLabelValues("undrained").Inc()
			logger.Info("upstream undrained", zap.String("upstream", dial), zap.String("cause", string(cause)))
		},
		Drained: func(dial string) {
			sh.metrics.drainTransitions.WithLabelValues("drained").Inc()
			logger.Info("upstream drained", zap.String("upstream", dial))
		},
		DeadlineCut: func(dial string, n int) {
			logger.Info("drain deadline passed; moving requests", zap.String("upstream", dial), zap.Int("requests", n))
		},
	}
}
