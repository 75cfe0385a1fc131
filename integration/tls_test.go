package integration

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// TestScrapesEnginesOverHTTPS: engines served over TLS (a certificate the
// system does not trust, as Caddy's internal CA's would not be) behind
// reverse_proxy https://… are scraped the way the proxy reaches them, with
// its TLS settings (tls_insecure_skip_verify, or the certificate as a
// trust pool), and the admin view shows their KV capacity.
func TestScrapesEnginesOverHTTPS(t *testing.T) {
	for _, tc := range []struct {
		name string
		tls  func(*httptest.Server) string // the transport's TLS settings
	}{
		{"insecure skip verify", func(*httptest.Server) string { return "tls_insecure_skip_verify" }},
		{"trust pool", func(hs *httptest.Server) string {
			path := filepath.Join(t.TempDir(), "engines.pem")
			block := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: hs.Certificate().Raw})
			if err := os.WriteFile(path, block, 0o600); err != nil {
				t.Fatal(err)
			}
			return "tls_trust_pool file " + path
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var dials []string
			var first *httptest.Server
			for i := range 2 {
				sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: fmt.Sprintf("tls-%d", i), Engine: kvsim.Config{NumGPUBlocks: 1024 * (i + 1)}})
				if err != nil {
					t.Fatal(err)
				}
				hs := httptest.NewTLSServer(sim) // every one serves httptest's one certificate
				t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
				dials = append(dials, strings.TrimPrefix(hs.URL, "https://"))
				if first == nil {
					first = hs
				}
			}
			startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy https://%s https://%s {
		lb_policy llm_affinity {
			scrape_interval 100ms
		}
		transport http {
			%s
		}
	}
}
`, routerHost, dials[0], dials[1], tc.tls(first)))
			for i, dial := range dials {
				waitScraped(t, dial, 1024*(i+1)*16) // blocks of 16 tokens
			}
			// And requests still go through the proxy over TLS.
			if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hello", "max_tokens": 4}); c.status != 200 {
				t.Fatalf("completion over TLS: %d %s", c.status, c.body)
			}
		})
	}
}

// TestScrapesExceptedPortsOverHTTP: with a transport that uses TLS but
// lists an engine's port in tls_except_ports, the proxy reaches that
// engine over plain HTTP, and so does the scraper; the TLS engine is
// still scraped over https.
func TestScrapesExceptedPortsOverHTTP(t *testing.T) {
	var dials []string
	for i, newServer := range []func(http.Handler) *httptest.Server{httptest.NewTLSServer, httptest.NewServer} {
		sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: fmt.Sprintf("except-%d", i), Engine: kvsim.Config{NumGPUBlocks: 1024 * (i + 1)}})
		if err != nil {
			t.Fatal(err)
		}
		hs := newServer(sim)
		t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
		dials = append(dials, hs.Listener.Addr().String())
	}
	_, plainPort, _ := net.SplitHostPort(dials[1])
	startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy %s %s {
		lb_policy llm_affinity {
			scrape_interval 100ms
		}
		transport http {
			tls
			tls_insecure_skip_verify
			tls_except_ports %s
		}
	}
}
`, routerHost, dials[0], dials[1], plainPort))
	for i, dial := range dials {
		waitScraped(t, dial, 1024*(i+1)*16) // blocks of 16 tokens
	}
	// Both engines answer through the proxy, each over its own scheme.
	for range 4 {
		if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hello", "max_tokens": 4}); c.status != 200 {
			t.Fatalf("completion: %d %s", c.status, c.body)
		}
	}
}

// TestScrapesEnginesRequiringClientCertificates: engines that accept only
// clients with a certificate they trust (mutual TLS) are scraped with the
// certificate the proxy presents (tls_client_auth), and a client without
// it is refused, so the scrape shows the certificate went along.
func TestScrapesEnginesRequiringClientCertificates(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "client.pem"), filepath.Join(dir, "client-key.pem")
	clientCert := writeClientCertificate(t, certFile, keyFile)
	trusted := x509.NewCertPool()
	trusted.AddCert(clientCert)

	sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: "mtls", Engine: kvsim.Config{NumGPUBlocks: 3072}})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewUnstartedServer(sim)
	hs.TLS = &tls.Config{ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: trusted}
	hs.StartTLS()
	t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
	dial := hs.Listener.Addr().String()

	// Without the certificate the engine refuses the metrics.
	if resp, err := hs.Client().Get(hs.URL + "/metrics"); err == nil {
		resp.Body.Close()
		t.Fatalf("the engine answered a client without a certificate: %s", resp.Status)
	}

	startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy https://%s {
		lb_policy llm_affinity {
			scrape_interval 100ms
		}
		transport http {
			tls_insecure_skip_verify
			tls_client_auth %s %s
		}
	}
}
`, routerHost, dial, certFile, keyFile))
	waitScraped(t, dial, 3072*16)
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hello", "max_tokens": 4}); c.status != 200 {
		t.Fatalf("completion over mutual TLS: %d %s", c.status, c.body)
	}
}

// writeClientCertificate writes a self-signed client certificate and its
// key as PEM files and returns the certificate.
func writeClientCertificate(t *testing.T, certFile, keyFile string) *x509.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "llm-affinity router"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		IsCA:         true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

// waitScraped waits until the admin view shows dial's KV capacity as
// capacity tokens, which only a successful scrape of the engine gives, and
// checks that no scrape error is left standing.
func waitScraped(t *testing.T, dial string, capacity int) {
	t.Helper()
	eventually(t, 10*time.Second, dial+"'s KV capacity in the admin view", func() bool {
		v := listedEngine(t, dial)
		return v != nil && v.KVCapacity == capacity
	})
	// A later scrape that failed otherwise than by running out of time
	// (a busy machine) says the scheme or the TLS settings are wrong for
	// some of the requests.
	if v := engineView(t, dial); v.LastError != "" && !strings.Contains(v.LastError, "deadline exceeded") && !strings.Contains(v.LastError, "timeout") {
		t.Errorf("%s: last scrape error %q after a successful scrape", dial, v.LastError)
	}
}
