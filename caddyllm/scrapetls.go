package caddyllm

import (
	"net/http"
	"slices"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// parentTLSTransport returns a copy of the HTTP transport of the reverse
// proxy this policy belongs to when that proxy reaches its upstreams over
// TLS (an https:// upstream, or a transport with a tls block), nil
// otherwise, and the ports it reaches over plain HTTP all the same (its
// tls_except_ports). The scraper must reach the engines the way the proxy does:
// the copy carries the proxy's TLS client configuration (trusted CAs,
// client certificate, server name, tls_insecure_skip_verify) and its
// dialer and timeouts, with a connection pool of its own.
//
// The parent provisions its transport before its selection policy, so it
// is ready when the policy is provisioned.
func parentTLSTransport(ctx caddy.Context) (*http.Transport, []string) {
	for _, m := range ctx.Modules() {
		h, ok := m.(*reverseproxy.Handler)
		if !ok {
			continue
		}
		t, ok := h.Transport.(*reverseproxy.HTTPTransport)
		if !ok || !t.TLSEnabled() || t.Transport == nil {
			return nil, nil
		}
		return t.Transport.Clone(), slices.Clone(t.TLS.ExceptPorts)
	}
	return nil, nil
}
