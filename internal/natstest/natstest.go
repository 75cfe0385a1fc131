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
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
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
