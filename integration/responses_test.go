package integration

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// TestResponsesAPIStaysWarm: a conversation through the Responses API,
// sent with the official OpenAI Go client, is routed by its prefix as a
// chat is: turn 2 (its tool call and output appended, streamed) lands
// where turn 1 did and the engine reports cache hits; the router reads
// both answers' usage and the stream's end, so both count as completed
// and the stream's first token is timed.
func TestResponsesAPIStaysWarm(t *testing.T) {
	fleet := startFleet(t, 4, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	client := openai.NewClient(option.WithBaseURL(routerURL+"/v1/"), option.WithAPIKey("unused"))
	ctx := context.Background()

	// The conversation's length is in its input, not the instructions:
	// the input's items must hash as they are sent again.
	question := responses.ResponseInputItemParamOfMessage(text("Here is my question", 12_000), responses.EasyInputMessageRoleUser)
	params := responses.ResponseNewParams{
		Model:           kvsim.DefaultModel,
		Instructions:    openai.String("Be brief."),
		Input:           responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{question}},
		MaxOutputTokens: openai.Int(8),
	}
	var first *http.Response
	answer, err := client.Responses.New(ctx, params, option.WithResponseInto(&first))
	if err != nil {
		t.Fatal(err)
	}
	said := answer.Output[0].AsMessage().ToParam()
	replica := first.Header.Get(kvsim.ReplicaHeader)
	if replica == "" || !strings.Contains(first.Header.Get("X-LLM-Affinity"), "reason=cold") {
		t.Fatalf("turn 1: replica %q, explanation %q", replica, first.Header.Get("X-LLM-Affinity"))
	}
	dial := named(fleet, replica).dial()
	eventually(t, 10*time.Second, "turn 1 completed", func() bool { return upstream(t, dial).Completed == 1 })
	// Other conversations spread load meanwhile.
	for i := range 6 {
		other := []msg{{"system", text("other"+string(rune('a'+i)), 8_000)}, {"user", "hi"}}
		if c := post(t, "/v1/chat/completions", chat(other, 8)); c.status != 200 {
			t.Fatalf("other conversation: %d %s", c.status, c.body)
		}
	}
	eventually(t, 10*time.Second, "the other conversations released", func() bool {
		for _, r := range fleet {
			if upstream(t, r.dial()).InFlight != 0 {
				return false
			}
		}
		return true
	})
	before := upstream(t, dial)

	// Turn 2 sends it all again: the question, the model's answer as it
	// came, a tool call and its output.
	params.Input = responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{
		question,
		{OfOutputMessage: &said},
		responses.ResponseInputItemParamOfFunctionCall(`{"a":6,"b":7}`, "call_1", "multiply"),
		{OfFunctionCallOutput: &responses.ResponseInputItemFunctionCallOutputParam{
			CallID: openai.String("call_1"),
			Output: responses.ResponseInputItemFunctionCallOutputOutputUnionParam{OfString: openai.String("42")},
		}},
	}}
	// A longer answer: its deltas are read by their shape (see
	// tokenRecorder.responseTokenEvents), and kvsim's words hold line
	// breaks and quotes, which the events carry escaped.
	params.MaxOutputTokens = openai.Int(64)
	var second *http.Response
	stream := client.Responses.NewStreaming(ctx, params, option.WithResponseInto(&second))
	var final responses.Response
	var streamed strings.Builder
	deltas := 0
	for stream.Next() {
		switch ev := stream.Current(); ev.Type {
		case "response.output_text.delta":
			deltas++
			streamed.WriteString(ev.Delta)
		case "response.completed", "response.incomplete":
			final = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if got := second.Header.Get(kvsim.ReplicaHeader); got != replica || !strings.Contains(second.Header.Get("X-LLM-Affinity"), "reason=warm") {
		t.Fatalf("turn 2 went to %s (%s), turn 1 to %s", got, second.Header.Get("X-LLM-Affinity"), replica)
	}
	if deltas != 64 || final.Usage.InputTokensDetails.CachedTokens < 2000 {
		t.Fatalf("turn 2: %d deltas, usage %+v", deltas, final.Usage)
	}
	if text := final.OutputText(); streamed.String() != text || !strings.ContainsAny(text, "\n\"") {
		t.Fatalf("turn 2: the deltas say %q, the response %q (with a line break or a quote to escape)", streamed.String(), text)
	}
	eventually(t, 10*time.Second, "turn 2 completed and released", func() bool {
		u := upstream(t, dial)
		return u.Completed == before.Completed+1 && u.InFlight == 0 && u.QueuedDecodeTokens == 0 &&
			len(u.RecentTTFTSeconds) == len(before.RecentTTFTSeconds)+1
	})
}

// TestPreviousResponseGoesHome: an engine keeps a stored response in its
// own memory, so a request naming it as previous_response_id, or
// retrieving it, can only be answered by the replica that answered it. Five conversations of three
// turns, each turn continuing the one before by id (the second streamed,
// its id learned from the stream's events), all succeed on their first
// turn's replica, with other traffic between them; spread over four
// replicas, about three in four would otherwise get the engine's 404.
func TestPreviousResponseGoesHome(t *testing.T) {
	fleet := startFleet(t, 4, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	client := openai.NewClient(option.WithBaseURL(routerURL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx := context.Background()
	for c := range 5 {
		params := responses.ResponseNewParams{
			Model:           kvsim.DefaultModel,
			Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(text(fmt.Sprint("conversation ", c), 4_000))},
			MaxOutputTokens: openai.Int(4),
		}
		var first *http.Response
		resp, err := client.Responses.New(ctx, params, option.WithResponseInto(&first))
		if err != nil {
			t.Fatalf("conversation %d turn 1: %v", c, err)
		}
		home := first.Header.Get(kvsim.ReplicaHeader)
		for i := range 3 {
			other := []msg{{"system", text(fmt.Sprint("other ", c, i), 6_000)}, {"user", "hi"}}
			if o := post(t, "/v1/chat/completions", chat(other, 4)); o.status != 200 {
				t.Fatalf("other traffic: %d %s", o.status, o.body)
			}
		}
		params.PreviousResponseID = openai.String(resp.ID)
		params.Input = responses.ResponseNewParamsInputUnion{OfString: openai.String("Go on.")}
		var second *http.Response
		stream := client.Responses.NewStreaming(ctx, params, option.WithResponseInto(&second))
		var id string
		for stream.Next() {
			if ev := stream.Current(); ev.Type == "response.created" {
				id = ev.Response.ID
			}
		}
		if err := stream.Err(); err != nil || second.Header.Get(kvsim.ReplicaHeader) != home || id == "" {
			t.Fatalf("conversation %d turn 2: %v, on %s (home %s), id %q", c, err, second.Header.Get(kvsim.ReplicaHeader), home, id)
		}
		params.PreviousResponseID = openai.String(id)
		var third *http.Response
		if _, err := client.Responses.New(ctx, params, option.WithResponseInto(&third)); err != nil || third.Header.Get(kvsim.ReplicaHeader) != home {
			t.Fatalf("conversation %d turn 3: %v (home %s)", c, err, home)
		}
		// Retrieving a stored response goes where it is too.
		if got, err := client.Responses.Get(ctx, resp.ID, responses.ResponseGetParams{}); err != nil || got.ID != resp.ID {
			t.Fatalf("conversation %d: retrieving %s: %v", c, resp.ID, err)
		}
	}
}

// TestPreviousResponseAfterItsHomeCrashed: a request naming a response
// whose replica has crashed (since the health checks last looked: here
// there are none) gets the 404 the API gives for a response it does not
// hold, from another replica, at once, where sending it to the home alone
// ended in the proxy's empty 502. Its first attempt reads EOF on the
// connection kept alive from turn 1 and is sent again to the home, whose
// port refuses it (with lb_retries, Caddy tries it there again first);
// the refusal tells the router nothing listens there, so it no longer
// counts that replica as the response's home, and sends the request
// again elsewhere.
//
// With lb_try_duration (and no passive health checks to mark the home
// unhealthy), Caddy asks the policy again after each refused attempt
// until that duration passes: the home is left after its first refusal
// (the attempt's body unread: no connection opened), not after 10 s of
// retries of it.
func TestPreviousResponseAfterItsHomeCrashed(t *testing.T) {
	for _, proxyOpts := range []string{"", "lb_retries 2", "lb_try_duration 10s\n\t\tlb_try_interval 50ms"} {
		t.Run(cmp.Or(proxyOpts, "no retries"), func(t *testing.T) { homeCrashed(t, proxyOpts) })
	}
}

func homeCrashed(t *testing.T, proxyOpts string) {
	fleet := startFleet(t, 3, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", proxyOpts))
	client, next, id, home := storeConversation(t)
	crash(fleet, home)
	var second *http.Response
	_, err := client.Responses.New(context.Background(), next, option.WithResponseInto(&second))
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound || !strings.Contains(apiErr.Message, id) {
		t.Fatalf("turn 2 after the home %s crashed: %v, want the 404 for %s", home, err, id)
	}
	if got := second.Header.Get(kvsim.ReplicaHeader); got == "" || got == home {
		t.Fatalf("the 404 came from %q (home %s)", got, home)
	}
	// The home once or twice (a kept-alive connection to it may close
	// under the first attempt, which is sent again), then another.
	explain := second.Header.Get("X-LLM-Affinity")
	_, after, _ := strings.Cut(explain, "attempt=") // the explanation's last field
	if attempt, err := strconv.Atoi(after); err != nil || attempt > 3 {
		t.Fatalf("the 404 came on attempt %q: %s", after, explain)
	}
}

// TestStoredResponseGetAfterItsHomeCrashed: a retrieval of a stored
// response (passed through, not parsed) goes to its home; once an attempt
// there gets no connection (the home crashed, and no health check has
// noticed), Caddy's retry goes to another replica, whose engine answers
// 404 at once, where every retry went to the dead home, ending in 502.
func TestStoredResponseGetAfterItsHomeCrashed(t *testing.T) {
	fleet := startFleet(t, 3, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", "lb_retries 2"))
	client, _, id, home := storeConversation(t)
	crash(fleet, home)
	var got *http.Response
	_, err := client.Responses.Get(context.Background(), id, responses.ResponseGetParams{}, option.WithResponseInto(&got))
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound {
		t.Fatalf("the stored response %s after its home %s crashed: %v, want the 404", id, home, err)
	}
	if r := got.Header.Get(kvsim.ReplicaHeader); r == "" || r == home {
		t.Fatalf("the 404 came from %q (home %s)", r, home)
	}
}

// TestDownEngineAvoided: once the scrape finds nothing listening at a
// replica (Caddy, without health checks, still counts it healthy), a
// stored response there is no home, so a request naming it gets another
// replica's 404 on its first attempt (before, the home alone was tried
// first, refused), and new requests stop trying that replica first (before,
// one in three paid a refused connection and a re-send).
func TestDownEngineAvoided(t *testing.T) {
	fleet := startFleet(t, 3, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tscrape_max_age 300ms\n\t\t\tmodels_interval 1s", ""))
	waitForModelLists(t, fleet)
	client, next, _, home := storeConversation(t)
	crash(fleet, home)
	// Until the scrape finds the home down, the request goes there first
	// and is refused: its 404 comes on a second attempt.
	eventually(t, 15*time.Second, "the 404 for the response on the first attempt", func() bool {
		var second *http.Response
		_, err := client.Responses.New(context.Background(), next, option.WithResponseInto(&second))
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound {
			t.Fatalf("turn 2 after its home %s crashed: %v, want the 404", home, err)
		}
		return strings.Contains(second.Header.Get("X-LLM-Affinity"), "attempt=1")
	})
	for i := range 12 {
		c := post(t, "/v1/chat/completions", chat([]msg{{"user", text(fmt.Sprint("after the crash ", i), 400)}}, 2))
		if c.status != 200 || !strings.Contains(c.explain, "attempt=1") {
			t.Fatalf("request %d with %s found down: %d, %s", i, home, c.status, c.explain)
		}
	}
}

// TestPreviousResponseHomeFailsOnce: a home that fails a request once,
// alive, is still the home: the request goes back to it and gets its
// answer, not another replica's 404. Its connection closed before an
// answer (a kept-alive connection the engine had closed) is sent again
// by the handler; its 503, which lb_retry_match retries, by Caddy.
func TestPreviousResponseHomeFailsOnce(t *testing.T) {
	for _, tc := range []struct {
		name, proxyOpts string
		fail            func(w http.ResponseWriter)
	}{
		{"connection closed", "", func(w http.ResponseWriter) {
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				c.Close()
			}
		}},
		{"503 retried by retry_match", "lb_retries 2\n\t\tlb_retry_match {\n\t\t\texpression `{rp.status_code} == 503`\n\t\t}",
			func(w http.ResponseWriter) { w.WriteHeader(http.StatusServiceUnavailable) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var once sync.Once
			wrap := func(_ string, sim http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if r.Method == http.MethodPost {
						b, _ := io.ReadAll(r.Body)
						r.Body = io.NopCloser(bytes.NewReader(b))
						fail := false
						if bytes.Contains(b, []byte("previous_response_id")) {
							once.Do(func() { fail = true })
						}
						if fail {
							tc.fail(w)
							return
						}
					}
					sim.ServeHTTP(w, r)
				})
			}
			fleet := startFleetServing(t, 3, 20, kvsim.Config{}, wrap)
			startCaddy(t, caddyfile(fleet, "", "", tc.proxyOpts))
			client, next, _, home := storeConversation(t)
			var second *http.Response
			_, err := client.Responses.New(context.Background(), next, option.WithResponseInto(&second))
			if err != nil || second.Header.Get(kvsim.ReplicaHeader) != home {
				t.Fatalf("turn 2, its home %s failing it once: %v, answered by %s", home, err, second.Header.Get(kvsim.ReplicaHeader))
			}
		})
	}
}

// storeConversation stores a response of a 2,000-byte prompt through the
// router, with the official client, and returns the client, the next
// turn's request naming it, its id and the replica that stored it.
func storeConversation(t *testing.T) (client openai.Client, next responses.ResponseNewParams, id, home string) {
	t.Helper()
	client = openai.NewClient(option.WithBaseURL(routerURL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	next = responses.ResponseNewParams{
		Model:           kvsim.DefaultModel,
		Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(text("a conversation", 2_000))},
		MaxOutputTokens: openai.Int(4),
	}
	var first *http.Response
	resp, err := client.Responses.New(context.Background(), next, option.WithResponseInto(&first))
	if err != nil {
		t.Fatalf("turn 1: %v", err)
	}
	next.PreviousResponseID = openai.String(resp.ID)
	next.Input = responses.ResponseNewParamsInputUnion{OfString: openai.String("Go on.")}
	return client, next, resp.ID, first.Header.Get(kvsim.ReplicaHeader)
}

// crash stops the server of the replica named name, as its engine's
// death would: its connections close, and its port refuses new ones.
func crash(fleet []*replica, name string) {
	if r := named(fleet, name); r != nil {
		r.http.CloseClientConnections()
		r.http.Close()
	}
}

// TestBackgroundResponseGoesHome: a background response (answered at
// once, queued, and generated after the answer) is remembered where it
// was answered, as a done one is: polled through the router, it is
// retrieved from that replica (the others would answer 404) until it is
// done, its cancellation goes there too, and its answer released its
// charge, though its generation goes on, without counting as a first
// token. Driven with the official client.
func TestBackgroundResponseGoesHome(t *testing.T) {
	fleet := startFleet(t, 3, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	client := openai.NewClient(option.WithBaseURL(routerURL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx := context.Background()
	params := func(maxOutput int64) responses.ResponseNewParams {
		return responses.ResponseNewParams{
			Model:           kvsim.DefaultModel,
			Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(text("a background story", 2_000))},
			MaxOutputTokens: openai.Int(maxOutput),
			Background:      openai.Bool(true),
		}
	}
	// TTFT series are the shared host's: other tests' counts stay.
	ttftCounts := func() map[string]string {
		counts := map[string]string{}
		for _, line := range strings.Split(scrapeMetrics(t), "\n") {
			if series, count, ok := strings.Cut(line, " "); ok && strings.HasPrefix(series, "caddy_llm_affinity_time_to_first_token_seconds_count{") {
				counts[series] = count
			}
		}
		return counts
	}
	ttftBefore := ttftCounts()
	var first *http.Response
	resp, err := client.Responses.New(ctx, params(200), option.WithResponseInto(&first))
	if err != nil || resp.Status != responses.ResponseStatusQueued {
		t.Fatalf("the answer: %v, %+v", err, resp)
	}
	home := first.Header.Get(kvsim.ReplicaHeader)
	eventually(t, 30*time.Second, "the background response done, retrieved through the router", func() bool {
		var got *http.Response
		r, err := client.Responses.Get(ctx, resp.ID, responses.ResponseGetParams{}, option.WithResponseInto(&got))
		if err != nil || got.Header.Get(kvsim.ReplicaHeader) != home {
			t.Fatalf("retrieved from %s (home %s): %v", got.Header.Get(kvsim.ReplicaHeader), home, err)
		}
		return r.Status == responses.ResponseStatusIncomplete && r.Usage.OutputTokens == 200
	})
	for _, u := range upstreams(t) {
		if u.InFlight != 0 {
			t.Fatalf("%s: %d requests in flight after the answers", u.Dial, u.InFlight)
		}
	}
	// The queued answer is no first token: no time to first token counted.
	for series, count := range ttftCounts() {
		if before, ok := ttftBefore[series]; count != "0" && (!ok || before != count) {
			t.Fatalf("a background answer counted as a first token: %s %s (before: %q)", series, count, before)
		}
	}
	long, err := client.Responses.New(ctx, params(1_000_000), option.WithResponseInto(&first))
	if err != nil {
		t.Fatal(err)
	}
	var cancelled *http.Response
	if r, err := client.Responses.Cancel(ctx, long.ID, option.WithResponseInto(&cancelled)); err != nil ||
		r.Status != responses.ResponseStatusCancelled || cancelled.Header.Get(kvsim.ReplicaHeader) != first.Header.Get(kvsim.ReplicaHeader) {
		t.Fatalf("cancel: %v, %+v, from %s (home %s)", err, r, cancelled.Header.Get(kvsim.ReplicaHeader), first.Header.Get(kvsim.ReplicaHeader))
	}
}

// TestStreamedBackgroundResponseResumesHome: a streamed background
// response (vLLM's background mode with stream=true) whose client leaves
// mid-stream goes on at its engine, and the client resumes it through the
// router (GET /v1/responses/{id}?stream=true&starting_after=N) from its
// home replica, to its end; the text read before and after the break is
// the stored response's. Read with the official client.
func TestStreamedBackgroundResponseResumesHome(t *testing.T) {
	fleet := startFleet(t, 3, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	client := openai.NewClient(option.WithBaseURL(routerURL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx := context.Background()
	var first *http.Response
	stream := client.Responses.NewStreaming(ctx, responses.ResponseNewParams{
		Model:           kvsim.DefaultModel,
		Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(text("a streamed background story", 2_000))},
		MaxOutputTokens: openai.Int(60),
		Background:      openai.Bool(true),
	}, option.WithResponseInto(&first))
	var id string
	var got strings.Builder
	last := int64(-1)
	for stream.Next() {
		ev := stream.Current()
		last = ev.SequenceNumber
		switch ev.Type {
		case "response.created":
			id = ev.Response.ID
		case "response.output_text.delta":
			got.WriteString(ev.Delta)
		}
		if got.Len() > 0 && last >= 6 {
			break // the client leaves mid-stream
		}
	}
	stream.Close()
	if id == "" || got.Len() == 0 || first == nil {
		t.Fatalf("before the break: id %q, text %q (%v)", id, got.String(), stream.Err())
	}
	home := first.Header.Get(kvsim.ReplicaHeader)
	// The Go client sends stream in a JSON body; vLLM reads the query.
	var resumedFrom *http.Response
	resumed := client.Responses.GetStreaming(ctx, id, responses.ResponseGetParams{StartingAfter: openai.Int(last)},
		option.WithQuery("stream", "true"), option.WithResponseInto(&resumedFrom))
	completed := false
	for resumed.Next() {
		ev := resumed.Current()
		if ev.SequenceNumber != last+1 {
			t.Fatalf("resumed with event %d after %d", ev.SequenceNumber, last)
		}
		last = ev.SequenceNumber
		switch ev.Type {
		case "response.output_text.delta":
			got.WriteString(ev.Delta)
		case "response.completed":
			completed = true
		}
	}
	if err := resumed.Err(); err != nil || !completed {
		t.Fatalf("the resumed stream: completed %v, %v", completed, err)
	}
	if from := resumedFrom.Header.Get(kvsim.ReplicaHeader); from != home {
		t.Fatalf("resumed from %s, its home is %s", from, home)
	}
	stored, err := client.Responses.Get(ctx, id, responses.ResponseGetParams{})
	if err != nil || stored.OutputText() != got.String() || stored.Usage.OutputTokens != 60 {
		t.Fatalf("stored: %v, %d tokens, %q; streamed %q", err, stored.Usage.OutputTokens, stored.OutputText(), got.String())
	}
}

// TestDrainMovesAQueuedResponsesStream: a Responses stream announces its
// response (response.created) before the engine has run it. At a drain
// deadline, the one still queued at the engine, its announcement held
// back, is sent again from the start to the other upstream: the client
// sees one response, completed. The one whose output had begun cannot be
// continued elsewhere (its events' ids and sequence numbers would
// restart) and ends with the API's error event.
func TestDrainMovesAQueuedResponsesStream(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{MaxNumSeqs: 1}) // one runs, one waits
	startCaddy(t, caddyfile(fleet, "", "drain_deadline 30s", ""))
	a, b := fleet[0], fleet[1]
	adminDo(t, "POST", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	client := openai.NewClient(option.WithBaseURL(routerURL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	type result struct {
		types []string
		ids   map[string]bool
		final responses.Response
		err   error
	}
	results := make([]result, 2)
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &results[i]
			r.ids = map[string]bool{}
			stream := client.Responses.NewStreaming(context.Background(), responses.ResponseNewParams{
				Model:           kvsim.DefaultModel,
				Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(text(fmt.Sprint("queued ", i), 400))},
				MaxOutputTokens: openai.Int(200),
			})
			for stream.Next() {
				ev := stream.Current()
				r.types = append(r.types, ev.Type)
				if ev.Response.ID != "" {
					r.ids[ev.Response.ID] = true
				}
				if ev.Type == "response.completed" {
					r.final = ev.Response
				}
			}
			r.err = stream.Err()
		}()
	}
	eventually(t, 5*time.Second, "both on A", func() bool { return upstreams(t)[a.dial()].InFlight == 2 })
	eventually(t, 5*time.Second, "one streaming from A", func() bool {
		return upstreams(t)[a.dial()].QueuedDecodeTokens <= 2*200-10
	})
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=100ms")
	wg.Wait()
	moved, cut := 0, 0
	for i, r := range results {
		last := ""
		if len(r.types) > 0 {
			last = r.types[len(r.types)-1]
		}
		switch {
		case r.err == nil && last == "response.completed" && len(r.ids) == 1 && r.types[0] == "response.created" && r.final.Usage.OutputTokens == 200:
			moved++
		case r.err == nil && last == "error":
			cut++
		default:
			t.Errorf("stream %d: %v, ids %v, events %v", i, r.err, r.ids, r.types)
		}
	}
	if moved != 1 || cut != 1 {
		t.Fatalf("%d moved and %d cut, want 1 and 1", moved, cut)
	}
	if m := scrapeMetrics(t); !strings.Contains(m, `caddy_llm_affinity_moved_requests_total{cause="drain",outcome="redispatched"}`) {
		t.Error("the queued stream's move was not counted")
	}
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")
}

// TestStoredResponsesAcrossRouters: two routers (Caddy processes) sync
// over a real NATS server; each turn of a Responses API conversation,
// sent with the official OpenAI Go client, names the last response as
// previous_response_id and goes through the other router than the turn
// before. A replica keeps a stored response in its own memory, so only
// the one that answered turn 1 can continue it: every turn must reach it,
// which the router that did not answer the turn before knows only from
// its peer. The test waits until both routers know the last response's
// home before the next turn (a real client takes longer than the few
// milliseconds the peer needs); streamed turns tell the peers at their
// first event.
func TestStoredResponsesAcrossRouters(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs two Caddy processes")
	}
	bin := buildCaddy(t)
	natsPort := freePort(t)
	natsServer(t, natsPort)
	natsURL := fmt.Sprintf("nats://127.0.0.1:%d", natsPort)
	fleet := startFleet(t, 4, 20, kvsim.Config{})
	routers := []*routerProc{
		startRouter(t, bin, "router-a", natsURL, fleet),
		startRouter(t, bin, "router-b", natsURL, fleet),
	}
	allConnected(t, routers)
	clients := make([]openai.Client, len(routers))
	for i, r := range routers {
		clients[i] = openai.NewClient(option.WithBaseURL(r.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	}
	ctx := context.Background()
	stored := 0
	bothKnow := func() {
		t.Helper()
		for _, r := range routers {
			eventually(t, 10*time.Second, fmt.Sprintf("%s knowing %d stored responses", r.name, stored), func() bool {
				return r.sync(t).ResponseHomes == stored
			})
		}
	}
	for c := range 4 {
		params := responses.ResponseNewParams{
			Model:           kvsim.DefaultModel,
			Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(text(fmt.Sprint("conversation ", c), 4_000))},
			MaxOutputTokens: openai.Int(4),
		}
		var first *http.Response
		resp, err := clients[c%2].Responses.New(ctx, params, option.WithResponseInto(&first))
		if err != nil {
			t.Fatalf("conversation %d turn 1: %v", c, err)
		}
		home, last := first.Header.Get(kvsim.ReplicaHeader), resp.ID
		stored++
		for turn := 2; turn <= 4; turn++ {
			bothKnow()
			client := clients[(c+turn-1)%2]
			params.PreviousResponseID = openai.String(last)
			params.Input = responses.ResponseNewParamsInputUnion{OfString: openai.String(fmt.Sprint("Go on, turn ", turn))}
			var got *http.Response
			if turn%2 == 0 {
				stream := client.Responses.NewStreaming(ctx, params, option.WithResponseInto(&got))
				last = ""
				for stream.Next() {
					if ev := stream.Current(); ev.Type == "response.completed" {
						last = ev.Response.ID
					}
				}
				err = stream.Err()
			} else {
				var r *responses.Response
				r, err = client.Responses.New(ctx, params, option.WithResponseInto(&got))
				if err == nil {
					last = r.ID
				}
			}
			if err != nil || last == "" || got.Header.Get(kvsim.ReplicaHeader) != home {
				t.Fatalf("conversation %d turn %d: %v, id %q, on %s (home %s)", c, turn, err, last, got.Header.Get(kvsim.ReplicaHeader), home)
			}
			stored++
		}
	}
	bothKnow()
}

// TestPassThroughLeavesADeadEngine: a request the router passes through
// (here GET /v1/models) leaves an engine found with nothing listening:
// Caddy's retry of an attempt that got no connection goes to the other
// replica, where the fallback choice could pick the dead one again (one
// request in four ended in 502, with two replicas and one retry), and,
// with scrape_interval, one the last scrape found down is not chosen
// first (one in two, without retries).
func TestPassThroughLeavesADeadEngine(t *testing.T) {
	for _, tc := range []struct{ name, policyOpts, proxyOpts string }{
		{"Caddy's retry", "", "lb_retries 1"},
		{"found down by the scrape", "scrape_interval 100ms\n\t\t\tscrape_max_age 300ms", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fleet := startFleet(t, 2, 20, kvsim.Config{})
			startCaddy(t, caddyfile(fleet, "", tc.policyOpts, tc.proxyOpts))
			crash(fleet, fleet[0].name)
			if tc.policyOpts != "" {
				eventually(t, 10*time.Second, "the scrape finding "+fleet[0].name+" down", func() bool {
					v := listedEngine(t, fleet[0].dial())
					return v != nil && strings.Contains(v.LastError, "refused")
				})
			}
			for i := range 40 {
				resp, err := http.Get(routerURL + "/v1/models")
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("request %d: %d", i, resp.StatusCode)
				}
			}
		})
	}
}
