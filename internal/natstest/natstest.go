// Package natstest runs a real NATS server in the test's own process, for
// the tests of several routers sharing a view.
package natstest

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Start runs a NATS server on 127.0.0.1:port (-1: any free port) until
// the test ends.
func Start(tb testing.TB, port int) *server.Server {
	tb.Helper()
	return StartWith(tb, &server.Options{Port: port})
}

// StartWith runs a NATS server with opts (users, permissions) on
// 127.0.0.1, quiet, until the test ends.
func StartWith(tb testing.TB, opts *server.Options) *server.Server {
	tb.Helper()
	opts.Host, opts.NoLog, opts.NoSigs = "127.0.0.1", true, true
	ns, err := server.NewServer(opts)
	if err != nil {
		tb.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		tb.Fatal("NATS server not ready")
	}
	tb.Cleanup(ns.Shutdown)
	return ns
}
