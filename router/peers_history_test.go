package router

import (
	"fmt"
	mrand "math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Random histories of routers sharing their view of one upstream: each
// receiver has its own queue of its peers' events (in order per sender,
// delivered some at a time), requests are decided, get their first token,
// fail (Release) or are refused (404), complete; the engine restarts;
// routers renew their names (their peers drop the old one and hear the
// restatement, with some events lost); one router may not keep its
// charges live; the index may be small enough to evict. Once every event
// has arrived, each index holds only blocks a prefill ran through since
// the last restart, or that a request still waiting for its first token
// routed: a lost hit is allowed, a false one is not.

type histMode struct {
	routers     int
	restart     int  // 0 none, 1 atomic (all routers at one step), 2 staggered (each router notes it at its own step)
	flushFirst  bool // atomic restart: every queue is delivered before the routers note it
	refuse      bool
	keepLiveOff int // router with KeepLive off, -1 none
	rename      bool
	capacity    int  // index blocks, 0 = large
	loss        bool // a rename loses some of the old name's charge events still on the way
}

func (m histMode) String() string {
	return fmt.Sprintf("routers=%d restart=%d flush=%v refuse=%v keepLiveOff=%d rename=%v capacity=%d",
		m.routers, m.restart, m.flushFirst, m.refuse, m.keepLiveOff, m.rename, m.capacity)
}

type histOpKind int

const (
	histDecide histOpKind = iota
	histFirst
	histFail
	histRefuse
	histComplete
	histDeliver
	histEngineRestart // the engine restarts (atomic mode: every router notes it now)
	histNote          // router notes the latest engine restart (staggered mode)
	histRename
)

type histOp struct {
	kind   histOpKind
	router int    // deciding router, receiver, noting router, renamed router
	req    int    // request number
	n      int    // deliver count
	seed   uint64 // prompt seed
}

func (o histOp) String() string {
	switch o.kind {
	case histDecide:
		return fmt.Sprintf("%c decides #%d (prompt %d)", 'a'+o.router, o.req, o.seed)
	case histFirst:
		return fmt.Sprintf("#%d first token", o.req)
	case histFail:
		return fmt.Sprintf("#%d fails (Release)", o.req)
	case histRefuse:
		return fmt.Sprintf("#%d refused (Refused)", o.req)
	case histComplete:
		return fmt.Sprintf("#%d completes", o.req)
	case histDeliver:
		return fmt.Sprintf("deliver %d to %c", o.n, 'a'+o.router)
	case histEngineRestart:
		return "engine restarts"
	case histNote:
		return fmt.Sprintf("%c notes the restart", 'a'+o.router)
	case histRename:
		return fmt.Sprintf("%c renames (peers DropPeer, restated LiveEvents)", 'a'+o.router)
	}
	return "?"
}

type histQueued struct {
	from int
	peer string
	ev   Event
	drop string // a rename marker: DropPeer(drop)
}

type histReq struct {
	router int
	c      *Charge
	chain  []uint64
	first  bool
	// epoch is the engine epoch of its first token.
	epoch int
}

// histPrompt is randomPrompt from a seed.
func histPrompt(seed uint64) Request {
	return randomPrompt(mrand.New(mrand.NewPCG(seed, 11)))
}

// histRun replays ops and returns "" or what went wrong, with the trace of
// the events applied.
func histRun(t *testing.T, mode histMode, ops []histOp, verbose bool) string {
	n := mode.routers
	fleets := make([]*Fleet, n)
	names := make([]string, n)
	queues := make([][]histQueued, n)
	var trace []string
	logf := func(format string, args ...any) {
		if verbose {
			trace = append(trace, fmt.Sprintf(format, args...))
		}
	}
	ms := members("x")
	ms[0].Hardware.KVCapacityTokens = 1 << 24
	opts := Options{}.WithDefaults()
	for i := range n {
		f := New()
		f.Name("x", t0)
		names[i] = string(rune('a' + i))
		f.KeepLive(i != mode.keepLiveOff)
		f.SetPublisher(func(ev Event) {
			ev.Hashes = slices.Clone(ev.Hashes)
			logf("  %c publishes %s", 'a'+i, histEvent(ev))
			for j := range n {
				if j != i {
					queues[j] = append(queues[j], histQueued{from: i, peer: names[i], ev: ev})
				}
			}
		})
		if mode.capacity > 0 {
			f.mu.Lock()
			u := f.upstreams["x"]
			u.capacityTokens, u.indexBlockTokens, u.capacitySeen = 1<<24, 64, t0
			f.index.SetCapacity(u.id, mode.capacity)
			f.mu.Unlock()
		}
		fleets[i] = f
	}
	epoch := 0
	renames := 0
	var reqs []*histReq
	deliverOne := func(j int) {
		e := queues[j][0]
		queues[j] = queues[j][1:]
		if e.drop != "" {
			logf("  %c DropPeer(%s)", 'a'+j, e.drop)
			fleets[j].DropPeer(e.drop, t0)
			return
		}
		logf("  %c applies %s's %s", 'a'+j, e.peer, histEvent(e.ev))
		fleets[j].Apply(e.peer, e.ev, t0)
	}
	flush := func() {
		for {
			moved := false
			for j := range n {
				for len(queues[j]) > 0 {
					deliverOne(j)
					moved = true
				}
			}
			if !moved {
				return
			}
		}
	}
	restartAt := func(j int) {
		fleets[j].EngineRestarted("x", t0.Add(time.Duration(epoch)*time.Second))
	}
	for _, op := range ops {
		var q *histReq
		if op.kind >= histFirst && op.kind <= histComplete {
			if op.req >= len(reqs) || reqs[op.req] == nil || reqs[op.req].c.up == nil {
				continue
			}
			q = reqs[op.req]
			if (op.kind == histComplete) != q.first {
				continue
			}
			if op.kind == histFirst && q.first {
				continue
			}
		}
		logf("%s", op)
		switch op.kind {
		case histDecide:
			req := histPrompt(op.seed)
			d := fleets[op.router].Decide(t0, req, ms, &opts, rng(), nil)
			for len(reqs) <= op.req {
				reqs = append(reqs, nil)
			}
			if d.Charge != nil {
				reqs[op.req] = &histReq{router: op.router, c: d.Charge, chain: req.Hashes}
				logf("  held %d of %d", d.Charge.held, len(req.Hashes))
			}
		case histFirst:
			fleets[q.router].Progress(q.c, 1, t0)
			q.first, q.epoch = true, epoch
		case histFail:
			fleets[q.router].Release(q.c, t0)
		case histRefuse:
			fleets[q.router].Refused(q.c, t0)
		case histComplete:
			fleets[q.router].Complete(q.c, "m", Usage{OutputTokens: 1}, t0)
		case histDeliver:
			for k := 0; k < op.n && len(queues[op.router]) > 0; k++ {
				deliverOne(op.router)
			}
		case histEngineRestart:
			epoch++
			if mode.flushFirst {
				flush()
			}
			if mode.restart == 1 {
				for j := range n {
					restartAt(j)
				}
			}
		case histNote:
			restartAt(op.router)
		case histRename:
			i := op.router
			old := names[i]
			renames++
			names[i] = fmt.Sprintf("%c#%d", 'a'+i, renames)
			for j := range n {
				if j == i {
					continue
				}
				if mode.loss {
					k := 0
					queues[j] = slices.DeleteFunc(queues[j], func(e histQueued) bool {
						k++
						lose := e.drop == "" && e.from == i && e.ev.Kind != EventForgot && e.ev.Kind != EventPrefilled && (op.seed>>(k%64))&1 == 1
						if lose {
							logf("  (%c loses %s's %s)", 'a'+j, e.peer, histEvent(e.ev))
						}
						return lose
					})
				}
				queues[j] = append(queues[j], histQueued{drop: old})
			}
			for _, ev := range fleets[i].LiveEvents() {
				logf("  %c restates %s", 'a'+i, histEvent(ev))
				for j := range n {
					if j != i {
						queues[j] = append(queues[j], histQueued{from: i, peer: names[i], ev: ev})
					}
				}
			}
		}
	}
	logf("(end: every router notes the restart, every queue delivered)")
	if mode.restart == 2 {
		for j := range n {
			restartAt(j)
		}
	}
	flush()
	allowed := map[uint64]bool{}
	for _, q := range reqs {
		if q == nil {
			continue
		}
		if q.first && q.epoch == epoch {
			for _, h := range q.chain {
				allowed[h] = true
			}
		}
		if q.c.up != nil && !q.first {
			for _, h := range q.chain {
				allowed[h] = true
			}
		}
	}
	for i, f := range fleets {
		for _, h := range f.index.Entries("x", nil) {
			if !allowed[h] {
				where := ""
				for k, q := range reqs {
					if q == nil {
						continue
					}
					if p := slices.Index(q.chain, h); p >= 0 {
						where += fmt.Sprintf(" #%d[%d]", k, p)
					}
				}
				return fmt.Sprintf("router %c holds a block (%s) no prefill since the last restart ran through and no waiting request routed\n%s",
					'a'+i, where, strings.Join(trace, "\n"))
			}
		}
	}
	return ""
}

func histEvent(ev Event) string {
	names := map[EventKind]string{EventRouted: "Routed", EventProgressed: "Progressed", EventCompleted: "Completed",
		EventReleased: "Released", EventForgot: "Forgot", EventPrefilled: "Prefilled"}
	s := fmt.Sprintf("%s{id %d", names[ev.Kind], ev.ID)
	if len(ev.Hashes) > 0 || ev.Kind == EventRouted {
		s += fmt.Sprintf(" %d blocks", len(ev.Hashes))
	}
	if ev.Kind == EventForgot {
		s += fmt.Sprintf(" from %d", ev.From)
	}
	return s + "}"
}

// histRandom makes a random history.
func histRandom(mode histMode, seed uint64, steps int) []histOp {
	r := mrand.New(mrand.NewPCG(seed, 13))
	var ops []histOp
	reqs := 0
	for range steps {
		k := r.IntN(20)
		switch {
		case k < 5:
			ops = append(ops, histOp{kind: histDecide, router: r.IntN(mode.routers), req: reqs, seed: r.Uint64()})
			reqs++
		case k < 8 && reqs > 0:
			ops = append(ops, histOp{kind: histFirst, req: r.IntN(reqs)})
		case k < 11 && reqs > 0:
			kind := histFail
			if mode.refuse && r.IntN(2) == 0 {
				kind = histRefuse
			}
			ops = append(ops, histOp{kind: kind, req: r.IntN(reqs)})
		case k < 12 && reqs > 0:
			ops = append(ops, histOp{kind: histComplete, req: r.IntN(reqs)})
		case k < 17:
			ops = append(ops, histOp{kind: histDeliver, router: r.IntN(mode.routers), n: 1 + r.IntN(4)})
		case k == 17 && mode.restart > 0:
			ops = append(ops, histOp{kind: histEngineRestart})
		case k == 18 && mode.restart == 2:
			ops = append(ops, histOp{kind: histNote, router: r.IntN(mode.routers)})
		case k == 19 && mode.rename:
			ops = append(ops, histOp{kind: histRename, router: r.IntN(mode.routers), seed: r.Uint64()})
		}
	}
	return ops
}

// histMinimise drops ops while the history still fails.
func histMinimise(t *testing.T, mode histMode, ops []histOp) []histOp {
	for changed := true; changed; {
		changed = false
		for i := 0; i < len(ops); i++ {
			try := slices.Delete(slices.Clone(ops), i, i+1)
			if histRun(t, mode, try, false) != "" {
				ops, changed = try, true
				i--
			}
		}
		// Smaller deliveries.
		for i := range ops {
			for ops[i].kind == histDeliver && ops[i].n > 1 {
				try := slices.Clone(ops)
				try[i].n--
				if histRun(t, mode, try, false) == "" {
					break
				}
				ops = try
				changed = true
			}
		}
	}
	return ops
}

func histModes() map[string]histMode {
	base := histMode{routers: 3, keepLiveOff: -1}
	with := func(f func(*histMode)) histMode { m := base; f(&m); return m }
	return map[string]histMode{
		"three":          base,
		"refuse":         with(func(m *histMode) { m.refuse = true }),
		"restartAtomic":  with(func(m *histMode) { m.restart, m.flushFirst = 1, true }),
		"restartSkew":    with(func(m *histMode) { m.restart, m.flushFirst = 2, true }),
		"keepLiveOff":    with(func(m *histMode) { m.keepLiveOff = 2 }),
		"rename":         with(func(m *histMode) { m.rename = true }),
		"evict":          with(func(m *histMode) { m.capacity = 8 }),
		"evict2routers":  with(func(m *histMode) { m.capacity = 8; m.routers = 2 }),
		"twoRename":      with(func(m *histMode) { m.rename = true; m.routers = 2 }),
		"twoKeepLiveOff": with(func(m *histMode) { m.keepLiveOff = 1; m.routers = 2 }),
		// Staggered restarts, with every event of before the restart
		// delivered first (see above).
		"all": with(func(m *histMode) {
			m.refuse, m.restart, m.flushFirst, m.keepLiveOff, m.rename, m.capacity = true, 2, true, 2, true, 8
		}),
		"allNoRestart": with(func(m *histMode) { m.refuse, m.keepLiveOff, m.rename, m.capacity = true, 2, true, 8 }),
		"renameLoss":   with(func(m *histMode) { m.rename, m.loss = true, true }),
		"tinyIndex":    with(func(m *histMode) { m.rename, m.loss, m.refuse, m.capacity = true, true, true, 3 }),
		"allNoRename":  with(func(m *histMode) { m.refuse, m.restart, m.flushFirst, m.keepLiveOff, m.capacity = true, 1, true, 2, 8 }),
	}
}

// TestPeersNeverClaimWhatNoEnginePrefilled runs histMode's histories,
// 150 seeds of each length in each mode; PEERS_SEEDS=n runs n, and
// PEERS_MODE=name one mode. A failing history is minimised and printed
// with every event applied.
//
// Left out: an engine restart a router notes while events from before it
// are still on their way to it, as a routing event carries no time: a routing from before the restart then
// inserts blocks the engine lost. Events arrive in milliseconds and an
// engine takes seconds to restart, and to be seen restarted.
func TestPeersNeverClaimWhatNoEnginePrefilled(t *testing.T) {
	seeds := uint64(150)
	if s := os.Getenv("PEERS_SEEDS"); s != "" {
		seeds, _ = strconv.ParseUint(s, 10, 64)
	}
	only := os.Getenv("PEERS_MODE")
	modes := histModes()
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range modes {
			if !yield(k) {
				return
			}
		}
	})
	for _, name := range keys {
		if only != "" && name != only {
			continue
		}
		mode := modes[name]
		t.Run(name, func(t *testing.T) {
			fails := 0
			var best []histOp
			for _, steps := range []int{8, 16, 30, 60, 120} {
				for seed := range seeds {
					ops := histRandom(mode, seed, steps)
					if histRun(t, mode, ops, false) != "" {
						fails++
						if best == nil || len(ops) < len(best)+8 {
							m := histMinimise(t, mode, ops)
							if best == nil || len(m) < len(best) {
								best = m
							}
						}
					}
				}
			}
			if fails > 0 {
				t.Errorf("%s: %d failing histories of %d; smallest:\n%s", mode, fails, 5*seeds, histRun(t, mode, best, true))
			}
		})
	}
}
