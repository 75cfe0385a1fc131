package caddyllm

import (
	"fmt"
	"math/rand"
	"net/http"
	"net/http/httptest"
	"testing"
)

// pooledRecorder returns a recorder whose state ran prime (split by
// primeSplits, on primeEP, left mid-event) and went through putBack's
// emptying (without the pool, so that the state is surely this one).
func pooledRecorder(w http.ResponseWriter, endpoint Endpoint, prime, primeSplits []byte, primeEP Endpoint, primeOp byte) *tokenRecorder {
	st := new(requestState)
	st.parsed = Request{Endpoint: primeEP, Stream: true}
	st.req = &st.parsed
	pw := httptest.NewRecorder()
	pw.Header().Set("Content-Type", "text/event-stream")
	rec := &st.recorder
	rec.init(pw, st)
	rec.WriteHeader(http.StatusOK)
	writeInPieces(rec, prime, primeSplits, func(k int) {
		if k == 3 {
			streamOp(rec, primeOp, func(string) {})
		}
	}, func(int, error) {})
	st.empty() // as putBack, without the pool

	st.parsed = Request{Endpoint: endpoint, Stream: true}
	st.req = &st.parsed
	rec.init(w, st)
	return rec
}

// runOn is recordStream on a given recorder, with a cut and continuation
// (op 3: dropUnsent, the continuation's text, splice) and endStream's
// flush of whole held events (op 4) too.
func runOn(rec *tokenRecorder, w *httptest.ResponseRecorder, stream, splits []byte, opAt int, op byte) *shapeRun {
	rec.WriteHeader(http.StatusOK)
	r := &shapeRun{rec: rec, w: w}
	writeInPieces(rec, stream, splits, func(k int) {
		if k == opAt {
			streamOp(rec, op, func(note string) { r.rets = append(r.rets, note) })
		}
	}, func(wn int, err error) {
		r.bodies = append(r.bodies, w.Body.String())
		r.rets = append(r.rets, fmt.Sprint(wn, err, recorderState(rec), rec.sentText, rec.sentTokens, rec.shapeText, rec.shapeSeq, string(rec.shape)))
	})
	rec.dropUnsent()
	r.rets = append(r.rets, "final text "+string(rec.generated))
	rec.flushHeld()
	r.bodies = append(r.bodies, w.Body.String())
	return r
}

// streamOp does to rec what the handler may do between two writes, by op:
// splice in a continuation (1), restart (2), cut and continue (3: what was
// sent and the continuation's text, noted), or end the stream after its
// whole events held back (4).
func streamOp(rec *tokenRecorder, op byte, note func(string)) {
	switch op % 5 {
	case 1:
		beginSplice(rec)
	case 2:
		rec.restart()
	case 3:
		rec.dropUnsent()
		note("continuation text " + string(rec.generated))
		beginSplice(rec)
	case 4:
		if rec.heldEvents > len(rec.held) {
			note(fmt.Sprintf("heldEvents %d > len(held) %d", rec.heldEvents, len(rec.held)))
		}
		rec.held = rec.held[:min(rec.heldEvents, len(rec.held))]
		rec.flushHeld()
	}
}

// newSSE is a client's end of a stream.
func newSSE() *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	w.Header().Set("Content-Type", "text/event-stream")
	return w
}

// sameFreshAndPooled runs stream (cut into writes by splits, op done
// before write opAt) on a fresh recorder and on one whose state served
// prime first, and fails on any difference in what they record or pass
// on.
func sameFreshAndPooled(t *testing.T, stream, splits []byte, endpoint Endpoint, opAt int, op byte, prime, primeSplits []byte, primeEP Endpoint, primeOp byte) {
	t.Helper()
	fw, pw := newSSE(), newSSE()
	fresh := runOn(newTokenRecorder(fw, &requestState{req: &Request{Endpoint: endpoint, Stream: true}}), fw, stream, splits, opAt, op)
	pooled := runOn(pooledRecorder(pw, endpoint, prime, primeSplits, primeEP, primeOp), pw, stream, splits, opAt, op)
	if len(fresh.rets) != len(pooled.rets) {
		t.Fatalf("stream %q: %d steps fresh, %d pooled", stream, len(fresh.rets), len(pooled.rets))
	}
	for k := range fresh.rets {
		if fresh.rets[k] != pooled.rets[k] {
			t.Fatalf("stream %q splits %v ep %v op %d@%d prime %q: step %d differs:\nfresh  %s\npooled %s", stream, splits, endpoint, op, opAt, prime, k, fresh.rets[k], pooled.rets[k])
		}
	}
	for k := range fresh.bodies {
		if fresh.bodies[k] != pooled.bodies[k] {
			t.Fatalf("stream %q: body after write %d differs:\nfresh  %q\npooled %q", stream, k, fresh.bodies[k], pooled.bodies[k])
		}
	}
}

// streamEndpoints are the endpoints whose streams the recorder reads.
var streamEndpoints = []Endpoint{EndpointChatCompletions, EndpointCompletions, EndpointResponses}

// FuzzFreshAndPooledAlike: a recorder whose state served another stream
// (of any endpoint, cut, spliced, restarted or left mid-event) and went
// back to the pool records and passes on what a fresh one does, write by
// write, continuation text included: the buffers it keeps carry nothing
// over.
func FuzzFreshAndPooledAlike(f *testing.F) {
	f.Add([]byte{0, 1, 0, 2, 0, 3, 4, 5, 5, 6, 0, 7, 9, 10, 10}, []byte{255, 255, 10, 3}, uint8(0), uint8(0), uint8(0), []byte{30, 1, 26, 1, 9, 26, 2, 10, 0, 5, 17, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9}, uint8(2))
	f.Add([]byte{30, 1, 26, 1, 9, 26, 2, 10, 27, 3, 0, 28, 16, 5, 26, 15, 6, 29, 0, 1, 7, 29, 1, 2, 8, 26, 17, 1, 30, 0, 5, 6}, []byte{255, 40, 3}, uint8(2), uint8(1), uint8(4), []byte{0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 21}, uint8(0))
	f.Add([]byte{0, 1, 0, 2, 15, 3, 16, 4, 19, 5, 6, 21, 7, 22, 0, 8, 23, 9, 0, 10}, []byte{5, 7, 250, 2, 1}, uint8(1), uint8(2), uint8(3), []byte{4, 5, 4, 6, 4, 7, 8, 9, 25, 1, 2}, uint8(5))
	f.Fuzz(func(t *testing.T, prog, splits []byte, ep, opAt, op uint8, primeProg []byte, primeEP uint8) {
		stream := shapeStream(prog)
		prime := shapeStream(primeProg)
		if len(stream) > 1<<15 || len(prime) > 1<<13 {
			return
		}
		endpoint := streamEndpoints[int(ep)%3]
		pep := streamEndpoints[int(primeEP)%3]
		sameFreshAndPooled(t, stream, splits, endpoint, int(opAt)%8, op, prime, splits, pep, primeEP>>2)
		sameFreshAndPooled(t, prog, splits, endpoint, int(opAt)%8, op, prime, nil, pep, primeEP>>2)
	})
}

// TestFreshAndPooledAlikeEverySplit is FuzzFreshAndPooledAlike's check
// for every split point of a few streams and primes.
func TestFreshAndPooledAlikeEverySplit(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for iter := 0; iter < 60; iter++ {
		prog := make([]byte, 4+rng.Intn(20))
		rng.Read(prog)
		primeProg := make([]byte, 10+rng.Intn(60))
		rng.Read(primeProg)
		stream := shapeStream(prog)
		prime := shapeStream(primeProg)
		ep := streamEndpoints[iter%3]
		for cut := 1; cut < len(stream); cut += 1 + len(stream)/64 {
			splits := []byte{}
			for rem := cut; rem > 0; {
				s := min(rem, 200)
				splits = append(splits, byte(s-1))
				rem -= s
			}
			for op := byte(0); op < 5; op++ {
				sameFreshAndPooled(t, stream, splits, ep, 1, op, prime, []byte{byte(rng.Intn(200))}, streamEndpoints[rng.Intn(3)], byte(rng.Intn(4)))
			}
		}
	}
}
