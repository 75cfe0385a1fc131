package caddyllm

import (
	"encoding/json"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmaffinity/caddy-llm-affinity/router"
)

func TestPolicyCaddyfile(t *testing.T) {
	d := caddyfile.NewTestDispenser(`llm_affinity {
		strategy sglang
		output_estimate max_tokens
		output_tokens 300
		prefill_rate 15000
		kv_capacity 131072
		upstream 10.0.0.2:8000 {
			prefill_rate 20000
			kv_capacity 262144
		}
		adapters a b
		queue_timeout 2s
		shed_status 429
		sglang 0.3 64 1.5
		llmd_weights 1 2 3
		tie 0.005
		imposed_delay_weight 0.25
		decode_weight 0.2
		queue_limit 64
		explain_header
		models_api_key {env.VLLM_API_KEY}
		fallback first
	}`)
	var p Policy
	if err := p.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if p.Strategy != "sglang" || p.OutputEstimate != "max_tokens" || p.OutputTokens != 300 ||
		p.Hardware.PrefillTokensPerSecond != 15000 || p.Hardware.KVCapacityTokens != 131072 ||
		p.Upstreams["10.0.0.2:8000"].PrefillTokensPerSecond != 20000 || len(p.Adapters) != 2 ||
		time.Duration(p.QueueTimeout) != 2*time.Second || p.ShedStatus != 429 ||
		p.SGLangBalanceAbs != 64 || p.LLMDWeights[2] != 3 || !p.ExplainHeader ||
		p.TieSeconds != 0.005 || p.ImposedDelayWeight != 0.25 || p.DecodeWeight != 0.2 || p.QueueLimit != 64 ||
		p.ModelsAPIKey != "{env.VLLM_API_KEY}" {
		t.Fatalf("parsed %+v", p)
	}
	var fb map[string]any
	if err := json.Unmarshal(p.FallbackRaw, &fb); err != nil || fb["policy"] != "first" {
		t.Fatalf("fallback %s", p.FallbackRaw)
	}
	hp := p.hardware("10.0.0.2:8000").WithDefaults()
	if hp.PrefillTokensPerSecond != 20000 || hp.DecodeTokensPerSecond != router.DefaultDecodeTokensPerSecond || hp.KVCapacityTokens != 262144 {
		t.Fatalf("profile %+v", hp)
	}
}

func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`llm_affinity { bogus }`, "unrecognized llm_affinity policy option 'bogus'"},
		{"llm_affinity {\n strategy\n}", "wrong argument count or unexpected line ending after 'strategy'"},
		{`llm_affinity { output_tokens many }`, `output_tokens: not an integer: "many"`},
		{"llm_affinity {\n sglang 0.5 32\n}", "wrong argument count"},
		{`llm_affinity extra`, "wrong argument count or unexpected line ending after 'extra'"},
		{`llm_affinity { queue_timeout soon }`, `parsing queue_timeout: time: invalid duration "soon"`},
		{"llm_affinity {\n imposed_delay_weight\n}", "wrong argument count or unexpected line ending after 'imposed_delay_weight'"},
		{`llm_affinity { imposed_delay_weight heavy }`, `imposed_delay_weight: not a finite number: "heavy"`},
		{`llm_affinity { imposed_delay_weight NaN }`, `imposed_delay_weight: not a finite number: "NaN"`},
		{`llm_affinity { tie Inf }`, `tie: not a finite number: "Inf"`},
		{"llm_affinity {\n prefill_rate fast\n}", `prefill_rate: not a finite number: "fast"`},
		{"llm_affinity {\n kv_capacity 1.5\n}", `kv_capacity: not an integer: "1.5"`},
		{"llm_affinity {\n strategy ttft\n strategy sglang\n}", "strategy already specified"},
		{"llm_affinity {\n output_estimate average\n output_estimate max_tokens\n}", "output_estimate already specified"},
		{"llm_affinity {\n upstream a:1 {\n kv_capacity 1\n }\n upstream a:1\n}", "upstream a:1 already specified"},
		// A profile on the upstream's own line would set pool-wide defaults.
		{"llm_affinity {\n upstream a:1 prefill_rate 20000\n}", "wrong argument count or unexpected line ending after 'prefill_rate'"},
		{"llm_affinity {\n upstream a:1 {\n kv_capacity 1 decode_rate 2\n }\n}", "wrong argument count or unexpected line ending after 'decode_rate'"},
		{"llm_affinity {\n queue_timeout 5s drain_deadline 1s\n}", "wrong argument count or unexpected line ending after 'drain_deadline'"},
		{"llm_affinity {\n tie 0.01 0.02\n}", "wrong argument count or unexpected line ending after '0.02'"},
		// Any option but a list or an upstream block, given twice.
		{"llm_affinity {\n queue_timeout 5s\n queue_timeout 1m\n}", "queue_timeout already specified"},
		{"llm_affinity {\n prefill_rate 1\n prefill_rate 2\n}", "prefill_rate already specified"},
		{"llm_affinity {\n sglang 0.5 32 1.5\n sglang 0.4 16 1.1\n}", "sglang already specified"},
		{"llm_affinity {\n tie 0.01\n tie 0.02\n}", "tie already specified"},
		{"llm_affinity {\n explain_header\n explain_header\n}", "explain_header already specified"},
		{"llm_affinity {\n upstream a:1 {\n kv_capacity 1\n kv_capacity 2\n }\n}", "kv_capacity already specified for upstream a:1"},
		{"llm_affinity {\n sync nats://a:1 {\n subject x\n subject y\n }\n}", "sync subject already specified"},
		{"llm_affinity {\n fallback first\n fallback random\n}", "fallback already specified"},
		// A list's later line without arguments.
		{"llm_affinity {\n adapters a\n adapters\n}", "wrong argument count"},
		{"llm_affinity {\n drain a:1\n drain\n}", "wrong argument count"},
	} {
		var p Policy
		err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want %q", tc.in, err, tc.want)
		}
	}
	for _, tc := range []struct{ in, want string }{
		{`llm_affinity { max_body lots }`, "parsing max_body"},
		// The whole message: humanize's error named an empty string.
		{`llm_affinity { max_body -1 }`, `parsing max_body "-1": want a size such as 32MiB or 1MB, at Testfile:1`},
		{`llm_affinity { max_body banana }`, `parsing max_body "banana": want a size such as 32MiB or 1MB, at Testfile:1`},
		{`llm_affinity { block_tokens x }`, `block_tokens: not an integer: "x"`},
		// Past int64 it would wrap negative, which means the default.
		{`llm_affinity { max_body 10EB }`, "max_body 10EB is larger than 1GiB"},
		{`llm_affinity { max_body 18446744073709551615 }`, "is larger than 1GiB"},
		{"llm_affinity {\n salt a\n salt b\n}", "salt already specified"},
	} {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("handler %q: error %v, want %q", tc.in, err, tc.want)
		}
	}
	// Lists may come in several lines.
	var p Policy
	if err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser("llm_affinity {\n adapters a\n adapters b c\n drain x:1\n drain y:1\n}")); err != nil ||
		!slices.Equal(p.Adapters, []string{"a", "b", "c"}) || !slices.Equal(p.Drain, []string{"x:1", "y:1"}) {
		t.Fatalf("lists in several lines: adapters %q, drain %q, %v", p.Adapters, p.Drain, err)
	}
	var h Handler
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(`llm_affinity {
		block_tokens 16
		max_body 1MiB
	}`)); err != nil || h.BlockTokens != 16 || h.MaxBodyBytes != 1<<20 {
		t.Fatalf("handler %+v %v", h, err)
	}
}

func TestPolicyValidate(t *testing.T) {
	for _, p := range []Policy{
		{OutputEstimate: "guess", ShedStatus: 503},
		{OutputEstimate: OutputAverage, ShedStatus: 200},
		{OutputEstimate: OutputAverage, ShedStatus: 503, LLMDWeights: []float64{1}},
		{OutputEstimate: OutputAverage, ShedStatus: 503, Hardware: &HardwareProfile{KVCapacityTokens: -1}},
		{OutputEstimate: OutputAverage, ShedStatus: 503, ImposedDelayWeight: 1e308},
		{OutputEstimate: OutputAverage, ShedStatus: 503, DecodeWeight: 101},
		{OutputEstimate: OutputAverage, ShedStatus: 503, ImposedDelayWeight: math.NaN()},
		{OutputEstimate: OutputAverage, ShedStatus: 503, TieSeconds: math.Inf(1)},
		{OutputEstimate: OutputAverage, ShedStatus: 503, KVMarginTokens: -100_000}, // would turn the KV fit off
		// Under a token a second: estimates centuries long.
		{OutputEstimate: OutputAverage, ShedStatus: 503, Hardware: &HardwareProfile{PrefillTokensPerSecond: 1e-300}},
		{OutputEstimate: OutputAverage, ShedStatus: 503, Upstreams: map[string]*HardwareProfile{"a:1": {DecodeTokensPerSecond: 0.5}}},
	} {
		if err := p.Validate(); err == nil {
			t.Errorf("%+v validated", p)
		}
	}
	ok := Policy{OutputEstimate: OutputAverage, ShedStatus: 503, Hardware: &HardwareProfile{PrefillTokensPerSecond: 1, DecodeTokensPerSecond: 120}}
	if err := ok.Validate(); err != nil {
		t.Errorf("rates of 1 and 120 tokens a second: %v", err)
	}
}

func TestSyncCaddyfile(t *testing.T) {
	var p Policy
	if err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser("llm_affinity {\n\tsync nats://127.0.0.1:4222\n}")); err != nil {
		t.Fatal(err)
	}
	if p.Sync == nil || len(p.Sync.URLs) != 1 || p.Sync.URLs[0] != "nats://127.0.0.1:4222" || p.Sync.Subject != "" {
		t.Fatalf("one-line form: %+v", p.Sync)
	}
	p = Policy{}
	if err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser(`llm_affinity {
		sync nats://nats-1:4222 nats://nats-2:4222 {
			subject   llm_affinity.pool-a
			name      router-1
			creds     /etc/nats/router.creds
			tls_ca    /etc/nats/ca.pem
		}
		explain_header
	}`)); err != nil {
		t.Fatal(err)
	}
	want := SyncConfig{URLs: []string{"nats://nats-1:4222", "nats://nats-2:4222"}, Subject: "llm_affinity.pool-a",
		Name: "router-1", Creds: "/etc/nats/router.creds", TLSCA: "/etc/nats/ca.pem"}
	if p.Sync == nil || !reflect.DeepEqual(*p.Sync, want) || !p.ExplainHeader {
		t.Fatalf("block form: %+v", p.Sync)
	}
	for _, tc := range []struct{ in, want string }{
		{"llm_affinity {\n\tsync\n}", "wrong argument count"},
		{"llm_affinity {\n\tsync nats://a:1 {\n\t\tcolour blue\n\t}\n}", "unrecognized sync option 'colour'"},
		{"llm_affinity {\n\tsync nats://a:1 {\n\t\tsubject\n\t}\n}", "wrong argument count"},
		{"llm_affinity {\n\tsync nats://a:1\n\tsync nats://b:1\n}", "sync already specified"},
	} {
		var p Policy
		if err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want %q", tc.in, err, tc.want)
		}
	}
}

// TestModelsAPIKeyPlaceholders: models_api_key's placeholders are replaced
// at load ({env.X}), braces that are none stay, and a key that comes out
// empty (an unset variable) is warned of.
func TestModelsAPIKeyPlaceholders(t *testing.T) {
	t.Setenv("LLM_AFFINITY_TEST_KEY", "k3y")
	for _, tc := range []struct {
		configured, want string
		warned           bool
	}{
		{"{env.LLM_AFFINITY_TEST_KEY}", "k3y", false},
		{"sk-{abc}", "sk-{abc}", false},
		{"{env.LLM_AFFINITY_TEST_UNSET}", "", true},
		{"", "", false},
	} {
		core, logs := observer.New(zapcore.WarnLevel)
		p := testPolicy(t, zap.New(core))
		p.ModelsAPIKey = tc.configured
		if got := p.modelsAPIKey(); got != tc.want || (logs.Len() > 0) != tc.warned {
			t.Errorf("%q: key %q, warned %v; want %q, %v", tc.configured, got, logs.Len() > 0, tc.want, tc.warned)
		}
	}
}
