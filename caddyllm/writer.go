package caddyllm

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// maxUsageBody bounds how much of a non-streaming response is kept to
// read its usage; longer bodies are passed through uncounted.
const maxUsageBody = 1 << 20

// maxSSELine bounds a buffered SSE line; a longer one is skipped.
const maxSSELine = 1 << 20

// tokenRecorder wraps the response writer to watch the tokens of an
// OpenAI-style response stream back: each SSE data event of a stream is
// one generated token, and the final usage (streamed with
// stream_options.include_usage, or in a plain JSON body) gives exact
// counts. Writes pass through unchanged and unbuffered.
type tokenRecorder struct {
	*caddyhttp.ResponseWriterWrapper
	st *requestState

	wroteHeader bool
	status      int
	sse         bool
	done        bool // saw data: [DONE] or a complete JSON body
	line        []byte
	skipLine    bool
	events      int
	body        bytes.Buffer
	usage       *usage
}

// usage is the OpenAI usage object.
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func newTokenRecorder(w http.ResponseWriter, st *requestState) *tokenRecorder {
	return &tokenRecorder{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, st: st}
}

// WriteHeader notes the status and whether the response is a stream.
func (t *tokenRecorder) WriteHeader(status int) {
	if !t.wroteHeader && status >= 200 {
		t.wroteHeader = true
		t.status = status
		t.sse = strings.HasPrefix(t.Header().Get("Content-Type"), "text/event-stream")
	}
	t.ResponseWriterWrapper.WriteHeader(status)
}

// Write counts tokens in p and passes it on.
func (t *tokenRecorder) Write(p []byte) (int, error) {
	if !t.wroteHeader {
		t.WriteHeader(http.StatusOK)
	}
	if t.status == http.StatusOK {
		if t.sse {
			if n := t.scan(p); n > 0 {
				t.st.progress(n)
			}
		} else if t.body.Len()+len(p) <= maxUsageBody {
			t.body.Write(p)
		}
	}
	return t.ResponseWriterWrapper.Write(p)
}

// scan splits p into SSE lines and returns the token events in it.
func (t *tokenRecorder) scan(p []byte) int {
	n := 0
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			if len(t.line)+len(p) > maxSSELine {
				t.skipLine, t.line = true, t.line[:0]
			} else if !t.skipLine {
				t.line = append(t.line, p...)
			}
			return n
		}
		line := p[:i]
		if len(t.line) > 0 {
			t.line = append(t.line, line...)
			line = t.line
		}
		if !t.skipLine && t.event(bytes.TrimSuffix(line, []byte{'\r'})) {
			n++
		}
		t.line, t.skipLine = t.line[:0], false
		p = p[i+1:]
	}
	return n
}

// event handles one SSE line and reports whether it carried a token.
func (t *tokenRecorder) event(line []byte) bool {
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return false
	}
	data = bytes.TrimSpace(data)
	if string(data) == "[DONE]" {
		t.done = true
		return false
	}
	if bytes.Contains(data, []byte(`"usage":{`)) || bytes.Contains(data, []byte(`"usage": {`)) {
		var chunk struct {
			Choices []json.RawMessage `json:"choices"`
			Usage   *usage            `json:"usage"`
		}
		if json.Unmarshal(data, &chunk) == nil && chunk.Usage != nil {
			t.usage = chunk.Usage
			if len(chunk.Choices) == 0 {
				return false // the usage-only final chunk
			}
		}
	}
	if bytes.Contains(data, []byte(`"error"`)) && !bytes.Contains(data, []byte(`"choices"`)) {
		return false
	}
	t.events++
	return true
}

// complete reports whether the response ended normally.
func (t *tokenRecorder) complete() bool {
	if t.sse {
		return t.done
	}
	var body struct {
		Usage *usage `json:"usage"`
	}
	if t.body.Len() == 0 || json.Unmarshal(t.body.Bytes(), &body) != nil || body.Usage == nil {
		return false
	}
	t.usage = body.Usage
	return true
}

// completionTokens is the output length: the usage's when reported, else
// the events counted.
func (t *tokenRecorder) completionTokens() int {
	if t.usage != nil {
		return t.usage.CompletionTokens
	}
	return t.events
}

// cachedTokens is the engine's reported prefix-cache hit, or -1.
func (t *tokenRecorder) cachedTokens() int {
	if t.usage == nil || t.usage.PromptTokensDetails == nil {
		return -1
	}
	return t.usage.PromptTokensDetails.CachedTokens
}
