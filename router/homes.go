package router

import (
	"container/list"
	"sync"
)

// MaxResponseHomes bounds the responses whose upstream the fleet
// remembers; the least recently used goes first.
const MaxResponseHomes = 1 << 16

// responseHomes remembers which upstream answered each stored response
// (the Responses API's store: an engine keeps a response in its own
// memory, so a request naming it as previous_response_id can only be
// answered there). It has a lock of its own: decisions need not wait on
// it.
type responseHomes struct {
	mu    sync.Mutex
	byID  map[string]*list.Element
	order list.List // of *responseHome, most recently used first
}

type responseHome struct{ id, dial string }

// RememberResponse notes that dial answered, and stored, the response id.
func (f *Fleet) RememberResponse(id, dial string) {
	if id == "" || dial == "" {
		return
	}
	h := &f.homes
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.byID == nil {
		h.byID = make(map[string]*list.Element)
	}
	if e, ok := h.byID[id]; ok {
		e.Value.(*responseHome).dial = dial
		h.order.MoveToFront(e)
		return
	}
	h.byID[id] = h.order.PushFront(&responseHome{id: id, dial: dial})
	if h.order.Len() > MaxResponseHomes {
		last := h.order.Back()
		h.order.Remove(last)
		delete(h.byID, last.Value.(*responseHome).id)
	}
}

// ResponseHome is the upstream that answered the stored response id, ""
// when the fleet does not know it.
func (f *Fleet) ResponseHome(id string) string {
	if id == "" {
		return ""
	}
	h := &f.homes
	h.mu.Lock()
	defer h.mu.Unlock()
	e, ok := h.byID[id]
	if !ok {
		return ""
	}
	h.order.MoveToFront(e)
	return e.Value.(*responseHome).dial
}
