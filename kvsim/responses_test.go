package kvsim

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

// TestOpenAIClientResponses: the official client's Responses API calls,
// streaming and not, get what OpenAI's and vLLM's answer: the text, the
// usage with the prefix cache's hits, incomplete at max_output_tokens,
// and a conversation sent again with a function call and its output.
func TestOpenAIClientResponses(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	client := openai.NewClient(option.WithBaseURL(srv.URL+"/v1/"), option.WithAPIKey("none"))
	ctx := context.Background()
	sys := strings.Repeat("You are a careful assistant. ", 40)
	first := responses.ResponseNewParams{
		Model:           DefaultModel,
		Instructions:    openai.String(sys),
		Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String("What is 6 times 7?")},
		MaxOutputTokens: openai.Int(5),
	}
	resp, err := client.Responses.New(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(resp.ID, "resp_") || resp.Status != responses.ResponseStatusIncomplete ||
		resp.IncompleteDetails.Reason != "max_output_tokens" || resp.Usage.OutputTokens != 5 ||
		len(resp.OutputText()) != 5*4 || resp.Usage.InputTokens < int64(len(sys)/4) {
		t.Fatalf("response %+v", resp)
	}

	// Turn 2 sends the conversation again, with a tool call and its
	// output: the engine's cache holds the instructions.
	items := responses.ResponseInputParam{
		responses.ResponseInputItemParamOfMessage("What is 6 times 7?", responses.EasyInputMessageRoleUser),
		responses.ResponseInputItemParamOfFunctionCall(`{"a":6,"b":7}`, "call_1", "multiply"),
		{OfFunctionCallOutput: &responses.ResponseInputItemFunctionCallOutputParam{
			CallID: openai.String("call_1"),
			Output: responses.ResponseInputItemFunctionCallOutputOutputUnionParam{OfString: openai.String("42")},
		}},
	}
	second := first
	second.Input = responses.ResponseNewParamsInputUnion{OfInputItemList: items}
	second.MaxOutputTokens = openai.Int(9)
	stream := client.Responses.NewStreaming(ctx, second)
	var text strings.Builder
	var types []string
	var done responses.Response
	for stream.Next() {
		ev := stream.Current()
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.output_text.delta":
			text.WriteString(ev.Delta)
		case "response.completed":
			done = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if types[0] != "response.created" || types[len(types)-1] != "response.completed" || done.Status != responses.ResponseStatusIncomplete || text.Len() != 9*4 ||
		done.OutputText() != text.String() || done.Usage.OutputTokens != 9 ||
		done.Usage.InputTokensDetails.CachedTokens < int64(len(sys)/4)-64 {
		t.Fatalf("events %v, text %q, final %+v", types, text.String(), done)
	}

	// A stored response is continued by its id, here and only here: the
	// engine renders the stored conversation before the new input, so
	// its prefix is cached; another server does not know the id.
	third, err := client.Responses.New(ctx, responses.ResponseNewParams{
		Model: DefaultModel, Instructions: openai.String(sys), PreviousResponseID: openai.String(resp.ID),
		Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String("And 7 times 8?")},
		MaxOutputTokens: openai.Int(3),
	})
	if err != nil {
		t.Fatal(err)
	}
	if third.Usage.InputTokens <= resp.Usage.InputTokens || third.Usage.InputTokensDetails.CachedTokens < resp.Usage.InputTokens-64 {
		t.Fatalf("continued: usage %+v after %+v", third.Usage, resp.Usage)
	}
	// It is retrieved by its id, here only.
	if got, err := client.Responses.Get(ctx, resp.ID, responses.ResponseGetParams{}); err != nil || got.ID != resp.ID || got.OutputText() != resp.OutputText() {
		t.Fatalf("retrieved %v: %v", got, err)
	}
	_, other := newTestServer(t, Config{})
	elsewhere := openai.NewClient(option.WithBaseURL(other.URL+"/v1/"), option.WithAPIKey("none"))
	var missing *openai.Error
	if _, err := elsewhere.Responses.Get(ctx, resp.ID, responses.ResponseGetParams{}); !errors.As(err, &missing) || missing.StatusCode != 404 {
		t.Fatalf("another server retrieved %s: %v", resp.ID, err)
	}
	_, err = elsewhere.Responses.New(ctx, responses.ResponseNewParams{
		Model: DefaultModel, PreviousResponseID: openai.String(resp.ID),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("And 7 times 8?")},
	})
	var notFound *openai.Error
	if !errors.As(err, &notFound) || notFound.StatusCode != 404 {
		t.Fatalf("another server continued %s: %v", resp.ID, err)
	}
	// store false keeps nothing.
	unstored, err := client.Responses.New(ctx, responses.ResponseNewParams{
		Model: DefaultModel, Store: openai.Bool(false), MaxOutputTokens: openai.Int(2),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("hi")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err = client.Responses.New(ctx, responses.ResponseNewParams{
		Model: DefaultModel, PreviousResponseID: openai.String(unstored.ID),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("again")},
	}); !errors.As(err, &notFound) || notFound.StatusCode != 404 {
		t.Fatalf("a response with store false was continued: %v", err)
	}

	// max_output_tokens beyond what the context leaves is cut to it, as
	// vLLM does for this API (chat and completions refuse it).
	_, small := newTestServer(t, Config{NumGPUBlocks: 64}) // 1,024 tokens
	tight := openai.NewClient(option.WithBaseURL(small.URL+"/v1/"), option.WithAPIKey("none"))
	capped, err := tight.Responses.New(ctx, responses.ResponseNewParams{
		Model: DefaultModel, MaxOutputTokens: openai.Int(100_000),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String(strings.Repeat("word ", 160))},
	})
	if err != nil {
		t.Fatal(err)
	}
	if capped.Status != responses.ResponseStatusIncomplete || capped.Usage.InputTokens+capped.Usage.OutputTokens != 1024 {
		t.Fatalf("capped: status %s, usage %+v", capped.Status, capped.Usage)
	}

	// An input of no known shape is the client's mistake.
	_, err = client.Responses.New(ctx, responses.ResponseNewParams{Model: DefaultModel})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 {
		t.Fatalf("no input: %v", err)
	}
}

// TestOtherAPIsFieldsIgnored: a field of another API is an extra field,
// which vLLM ignores whatever it holds; store is read leniently.
func TestOtherAPIsFieldsIgnored(t *testing.T) {
	tok := NewTokenizer(4)
	for _, tc := range []struct {
		ep   Endpoint
		body string
	}{
		{EndpointCompletions, `{"prompt":"p","messages":42,"max_completion_tokens":"x","input":5}`},
		{EndpointChatCompletions, `{"messages":[{"role":"user","content":"hi"}],"prompt":7,"max_output_tokens":"x","store":"no"}`},
		{EndpointResponses, `{"input":"hi","max_tokens":"x","messages":1,"n":"two","store":"false"}`},
		{EndpointResponses, `{"input":"hi","n":2,"stream_options":{"include_usage":true},"store":false}`}, // decodes at once: still not read
	} {
		p, err := ParseRequest(tc.ep, []byte(tc.body), tok, 16)
		if err != nil {
			t.Errorf("%s: %v", tc.body, err)
			continue
		}
		if tc.ep == EndpointResponses && p.Store {
			t.Errorf(`%s: store "false" read as true`, tc.body)
		}
	}
	// As pydantic reads a boolean: its words and 0 and 1, nothing else.
	// null is None in vLLM's request, which stores nothing.
	for body, want := range map[string]bool{`"store":"YES"`: true, `"store":1`: true, `"store":0.0`: false, `"store":null`: false, `"stream":false`: true} {
		p, err := ParseRequest(EndpointResponses, []byte(`{"input":"hi",`+body+`}`), tok, 16)
		if err != nil || p.Store != want {
			t.Errorf("%s: store %v, %v; want %v", body, p.Store, err, want)
		}
	}
	for _, body := range []string{`"store":"maybe"`, `"store":2`, `"store":[]`} {
		if _, err := ParseRequest(EndpointResponses, []byte(`{"input":"hi",`+body+`}`), tok, 16); err == nil {
			t.Errorf("%s accepted; vLLM answers 400", body)
		}
	}
}

// backgroundParams asks for a background response to input of at most
// maxOutput tokens.
func backgroundParams(input string, maxOutput int64) responses.ResponseNewParams {
	return responses.ResponseNewParams{
		Model:           DefaultModel,
		Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(input)},
		MaxOutputTokens: openai.Int(maxOutput),
		Background:      openai.Bool(true),
	}
}

// TestBackgroundResponses: a background response (vLLM's background mode)
// is answered at once, queued, and generated after the answer; retrieved
// by its id it comes in progress, then done with its text and usage. One
// cancelled before it is done stays cancelled, and cannot be cancelled
// again; a done one cannot be cancelled. Background needs store (see
// TestBackgroundResponsesStream for one streamed). Driven with the
// official client.
func TestBackgroundResponses(t *testing.T) {
	sim, srv := newTestServer(t, Config{})
	client := openai.NewClient(option.WithBaseURL(srv.URL+"/v1/"), option.WithAPIKey("none"), option.WithMaxRetries(0))
	ctx := context.Background()
	resp, err := client.Responses.New(ctx, backgroundParams("Tell me a long story.", 20))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Status != responses.ResponseStatusQueued || !resp.Background || resp.OutputText() != "" {
		t.Fatalf("the answer: status %s, background %v, text %q", resp.Status, resp.Background, resp.OutputText())
	}
	deadline := time.Now().Add(30 * time.Second)            // the test's, for both waits
	for resp.Status != responses.ResponseStatusIncomplete { // done at max_output_tokens
		if time.Now().After(deadline) {
			t.Fatalf("still %s", resp.Status)
		}
		time.Sleep(10 * time.Millisecond)
		if resp, err = client.Responses.Get(ctx, resp.ID, responses.ResponseGetParams{}); err != nil {
			t.Fatal(err)
		}
		if s := resp.Status; s != responses.ResponseStatusQueued && s != responses.ResponseStatusInProgress && s != responses.ResponseStatusIncomplete {
			t.Fatalf("retrieved as %s", s)
		}
	}
	if resp.Usage.OutputTokens != 20 || resp.OutputText() == "" {
		t.Fatalf("done: %d output tokens, text %q", resp.Usage.OutputTokens, resp.OutputText())
	}
	var apiErr *openai.Error
	if _, err := client.Responses.Cancel(ctx, resp.ID); !errors.As(err, &apiErr) || apiErr.StatusCode != 400 {
		t.Fatalf("cancelling a done response: %v", err)
	}

	long, err := client.Responses.New(ctx, backgroundParams("Tell me a long story.", 1_000_000))
	if err != nil {
		t.Fatal(err)
	}
	cancelled, err := client.Responses.Cancel(ctx, long.ID)
	if err != nil || cancelled.Status != responses.ResponseStatusCancelled {
		t.Fatalf("cancel: %v, %+v", err, cancelled)
	}
	if _, err := client.Responses.Cancel(ctx, long.ID); !errors.As(err, &apiErr) || apiErr.StatusCode != 400 {
		t.Fatalf("cancelling twice: %v", err)
	}
	if got, err := client.Responses.Get(ctx, long.ID, responses.ResponseGetParams{}); err != nil || got.Status != responses.ResponseStatusCancelled {
		t.Fatalf("the cancelled response retrieved: %v, %s", err, got.Status)
	}
	// Its sequence leaves the engine (it would generate a million tokens).
	for st := sim.State(); st.InFlight > 0 || st.Aborted == 0; st = sim.State() {
		if time.Now().After(deadline) {
			t.Fatalf("the cancelled response still runs: %+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := client.Responses.Cancel(ctx, "resp_unknown"); !errors.As(err, &apiErr) || apiErr.StatusCode != 404 {
		t.Fatalf("cancelling an unknown response: %v", err)
	}

	noStore := backgroundParams("Tell me a long story.", 5)
	noStore.Store = openai.Bool(false)
	if _, err := client.Responses.New(ctx, noStore); !errors.As(err, &apiErr) || apiErr.StatusCode != 400 {
		t.Fatalf("background without store: %v", err)
	}
}

// TestBackgroundResponsesStream: a streamed background response (vLLM's
// background mode with stream=true) goes on when its client leaves the
// stream, and GET /v1/responses/{id}?stream=true&starting_after=N resumes
// it after event N, to its end; read with the official client. Its text
// is whole: the deltas before and after the break make the stored
// response's. A response not streamed in the background has no events to
// resume (400), and a cancellation ends the stream.
func TestBackgroundResponsesStream(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	client := openai.NewClient(option.WithBaseURL(srv.URL+"/v1/"), option.WithAPIKey("none"), option.WithMaxRetries(0))
	ctx := context.Background()
	first := client.Responses.NewStreaming(ctx, backgroundParams("Tell me a long story.", 40))
	var id string
	var text strings.Builder
	last := int64(-1)
	for first.Next() {
		ev := first.Current()
		if ev.SequenceNumber != last+1 {
			t.Fatalf("event %d after %d", ev.SequenceNumber, last)
		}
		last = ev.SequenceNumber
		switch ev.Type {
		case "response.created":
			id = ev.Response.ID
			if !ev.Response.Background {
				t.Fatalf("created: %+v", ev.Response)
			}
		case "response.output_text.delta":
			text.WriteString(ev.Delta)
		}
		if text.Len() > 0 && last >= 6 {
			break // the client leaves mid-stream
		}
	}
	first.Close()
	if id == "" || text.Len() == 0 {
		t.Fatalf("before the break: id %q, text %q (%v)", id, text.String(), first.Err())
	}
	// The Go client sends stream as a JSON field of the GET; vLLM, as
	// FastAPI, reads the query (the Python client's way): say it there.
	streamQuery := option.WithQuery("stream", "true")
	resumed := client.Responses.GetStreaming(ctx, id, responses.ResponseGetParams{StartingAfter: openai.Int(last)}, streamQuery)
	completed := false
	for resumed.Next() {
		ev := resumed.Current()
		if ev.SequenceNumber != last+1 {
			t.Fatalf("resumed with event %d after %d", ev.SequenceNumber, last)
		}
		last = ev.SequenceNumber
		switch ev.Type {
		case "response.output_text.delta":
			text.WriteString(ev.Delta)
		case "response.completed":
			completed = true
		}
	}
	if err := resumed.Err(); err != nil || !completed {
		t.Fatalf("the resumed stream: completed %v, %v", completed, err)
	}
	stored, err := client.Responses.Get(ctx, id, responses.ResponseGetParams{})
	if err != nil || stored.OutputText() != text.String() || stored.Usage.OutputTokens != 40 {
		t.Fatalf("stored: %v, %d tokens, %q; streamed %q", err, stored.Usage.OutputTokens, stored.OutputText(), text.String())
	}

	var apiErr *openai.Error
	plain, err := client.Responses.New(ctx, responses.ResponseNewParams{Model: DefaultModel,
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("hi")}, MaxOutputTokens: openai.Int(3)})
	if err != nil {
		t.Fatal(err)
	}
	s := client.Responses.GetStreaming(ctx, plain.ID, responses.ResponseGetParams{}, streamQuery)
	if s.Next() || !errors.As(s.Err(), &apiErr) || apiErr.StatusCode != 400 {
		t.Fatalf("streaming a response not streamed in the background: %v", s.Err())
	}
	resp, err := http.Get(srv.URL + "/v1/responses/" + id + "?stream=true&starting_after=x")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Fatalf("starting_after=x: %d", resp.StatusCode)
	}

	// Cancelled at its first text, a million-token stream ends.
	ended := make(chan error, 1)
	go func() {
		long := client.Responses.NewStreaming(ctx, backgroundParams("Tell me a long story.", 1_000_000))
		defer long.Close()
		longID, cancelled := "", false
		for long.Next() {
			switch ev := long.Current(); ev.Type {
			case "response.created":
				longID = ev.Response.ID
			case "response.output_text.delta":
				if !cancelled {
					cancelled = true
					if _, err := client.Responses.Cancel(ctx, longID); err != nil {
						ended <- err
						return
					}
				}
			case "response.completed":
				ended <- errors.New("a cancelled response completed")
				return
			}
		}
		ended <- long.Err()
	}()
	select {
	case err := <-ended:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a cancelled streamed background response's stream did not end")
	}
}

// TestBackgroundStreamEdges: starting_after at the largest integer sends
// nothing (it once wrapped to replay everything), stream takes FastAPI's
// boolean words, and only the latest maxEventLogs streamed background
// responses keep their events.
func TestBackgroundStreamEdges(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	client := openai.NewClient(option.WithBaseURL(srv.URL+"/v1/"), option.WithAPIKey("none"), option.WithMaxRetries(0))
	ctx := context.Background()
	start := func() string {
		s := client.Responses.NewStreaming(ctx, backgroundParams("hi", 3))
		defer s.Close()
		id := ""
		for s.Next() {
			if ev := s.Current(); ev.Type == "response.created" {
				id = ev.Response.ID
			}
		}
		if s.Err() != nil || id == "" {
			t.Fatalf("a streamed background response: %q, %v", id, s.Err())
		}
		return id
	}
	id := start()
	get := func(query string) (int, string) {
		t.Helper()
		resp, err := http.Get(srv.URL + "/v1/responses/" + id + "?" + query)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("stream=true&starting_after=9223372036854775807"); code != 200 || body != "" {
		t.Fatalf("after the largest sequence number: %d, %d bytes", code, len(body))
	}
	for _, word := range []string{"yes", "On", "1", "t"} {
		if code, body := get("stream=" + word); code != 200 || !strings.Contains(body, "response.completed") {
			t.Fatalf("stream=%s: %d %.80s", word, code, body)
		}
	}
	if code, _ := get("stream=maybe"); code != 400 {
		t.Fatalf("stream=maybe: %d", code)
	}
	for range maxEventLogs {
		start()
	}
	if code, body := get("stream=true"); code != 400 {
		t.Fatalf("the events of a response %d streamed ones ago: %d %.80s", maxEventLogs, code, body)
	}
	if code, _ := get(""); code != 200 {
		t.Fatalf("the response itself, its events dropped: %d", code)
	}
}

// TestCancelledBackgroundStreamDoesNotComplete: a streamed background
// response cancelled while its last tokens wait unread at the engine logs
// no response.completed (next used to pick at random between the
// cancellation and the ready tokens), as the stored response says
// cancelled.
func TestCancelledBackgroundStreamDoesNotComplete(t *testing.T) {
	sim, _ := newTestServer(t, Config{})
	completed := 0
	const runs = 20
	for range runs {
		body := `{"model":"` + DefaultModel + `","input":"hi","background":true,"stream":true,"max_output_tokens":3}`
		p, err := ParseRequest(EndpointResponses, []byte(body), sim.tok, sim.cfg.DefaultOutputTokens)
		if err != nil {
			t.Fatal(err)
		}
		req := &Request{ID: newID("resp_"), Context: p.Context, OutputTokens: p.OutputTokens,
			LengthLimited: p.LengthLimited, CapOutput: p.CapsMaxTokens}
		stream, err := sim.driver.Submit(req)
		if err != nil {
			t.Fatal(err)
		}
		for sim.driver.InFlight() > 0 { // all its events wait in the stream
			time.Sleep(time.Millisecond)
		}
		stop := make(chan struct{})
		close(stop) // cancelled (handleCancel: status cancelled, cancel nil)
		sim.responses.put(req.ID, storedResponse{object: map[string]any{"status": "cancelled"}})
		rs := &responder{s: sim, p: p, req: req, stream: stream, model: DefaultModel, gone: stop}
		events := newEventLog()
		rs.runBackground("msg_x", events)
		frames, _, _ := events.from(0)
		for _, f := range frames {
			if strings.HasPrefix(string(f), "event: response.completed") {
				completed++
			}
		}
	}
	if completed > 0 {
		t.Errorf("%d of %d cancelled streams logged response.completed", completed, runs)
	}
}

// TestEmptyPreviousResponseID: vLLM looks previous_response_id up
// whenever it is not None, "" too, and holds no response of that id: 404,
// where kvsim took "" for none and answered 200.
func TestEmptyPreviousResponseID(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	resp, out := post(t, srv.URL+"/v1/responses", `{"input":"hi","max_output_tokens":2,"previous_response_id":""}`)
	want := `{"error":{"message":"Response with id '' not found.","type":"invalid_request_error","param":null,"code":404}}`
	if resp.StatusCode != 404 || strings.TrimSpace(out) != want {
		t.Errorf("%d %s\nwant 404 %s", resp.StatusCode, out, want)
	}
	if resp, out := post(t, srv.URL+"/v1/responses", `{"input":"hi","max_output_tokens":2,"previous_response_id":null}`); resp.StatusCode != 200 {
		t.Errorf("null: %d %s", resp.StatusCode, out)
	}
}
