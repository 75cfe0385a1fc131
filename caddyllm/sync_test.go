package caddyllm

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/fleetsync"
	"github.com/llmaffinity/caddy-llm-affinity/internal/natstest"
)

// TestSyncCountersSurviveClosing: the sync counters keep what a connection
// counted after it closes (a reload that changes the sync options): a
// Prometheus counter that goes down reads as a reset.
func TestSyncCountersSurviveClosing(t *testing.T) {
	ns := natstest.Start(t, -1)
	sh := newShared()
	defer sh.Destruct()
	key, err := sh.acquireSync(SyncConfig{URLs: []string{ns.ClientURL()}, Subject: "counters-test", Name: "counting"}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	sent := func() float64 {
		for _, s := range sh.loadSyncers() {
			return float64(s.Stats().Sent)
		}
		return -1
	}
	for deadline := time.Now().Add(10 * time.Second); sent() < 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("nothing sent")
		}
		sh.publish(fleetsync.Message{Drain: "counted:1", Deadline: time.Second})
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(newSyncCollector(sh))
	sentCounted := func() float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "caddy_llm_affinity_sync_events_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				if m.GetLabel()[0].GetValue() == "sent" {
					return m.GetCounter().GetValue()
				}
			}
		}
		return -1
	}
	before := sentCounted()
	if before < 1 {
		t.Fatalf("sent events counted before closing: %v", before)
	}
	sh.releaseSync(key) // the last reference: the connection closes
	if len(sh.loadSyncers()) != 0 {
		t.Fatal("the connection is still in use")
	}
	if after := sentCounted(); after < before {
		t.Fatalf("sent events counted after closing: %v, before %v", after, before)
	}
}
