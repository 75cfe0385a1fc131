package router

import (
	"container/list"
	"sync"
)

// MaxResponseHomes bounds the responses whose upstream the fleet
// remembers; the least recently used goes first. MaxResponseIDBytes
// bounds an id it remembers (engines' are under 64 bytes).
const (
	MaxResponseHomes   = 1 << 16
	MaxResponseIDBytes = 256
)

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

// RememberResponse notes that dial answered, and stored, the response id,
// and tells the peers (EventStored): the next request of the conversation
// may reach any router.
func (f *Fleet) RememberResponse(id, dial string) {
	if !f.homes.remember(id, dial) {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.publish(Event{Kind: EventStored, Dial: dial, Response: id})
}

// remember notes id's home and reports whether that is news: an id not
// known, or known elsewhere.
func (h *responseHomes) remember(id, dial string) bool {
	if !validHome(id, dial) {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if e, ok := h.byID[id]; ok {
		home := e.Value.(*responseHome)
		h.order.MoveToFront(e)
		news := home.dial != dial
		home.dial = dial
		return news
	}
	h.add(id, h.order.PushFront(&responseHome{id: id, dial: dial}))
	if h.order.Len() > MaxResponseHomes {
		last := h.order.Back()
		h.order.Remove(last)
		delete(h.byID, last.Value.(*responseHome).id)
	}
	return true
}

// forget drops what is known of id's home.
func (h *responseHomes) forget(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if e, ok := h.byID[id]; ok {
		h.order.Remove(e)
		delete(h.byID, id)
	}
}

// newestFirst returns the homes known, most recently used first.
func (h *responseHomes) newestFirst() []responseHome {
	h.mu.Lock()
	defer h.mu.Unlock()
	homes := make([]responseHome, 0, h.order.Len())
	for e := h.order.Front(); e != nil; e = e.Next() {
		homes = append(homes, *e.Value.(*responseHome))
	}
	return homes
}

// restore notes id's home as a peer's snapshot has it, less recently used
// than every home known, and reports whether it did: an id known already
// keeps what this router learned, and a full table evicts nothing.
func (h *responseHomes) restore(id, dial string) bool {
	if !validHome(id, dial) {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.byID[id]; ok || h.order.Len() >= MaxResponseHomes {
		return false
	}
	h.add(id, h.order.PushBack(&responseHome{id: id, dial: dial}))
	return true
}

// validHome reports whether a home of id at dial may be remembered.
func validHome(id, dial string) bool {
	return id != "" && dial != "" && len(id) <= MaxResponseIDBytes
}

// add indexes the list element e of id. Caller holds h.mu.
func (h *responseHomes) add(id string, e *list.Element) {
	if h.byID == nil {
		h.byID = make(map[string]*list.Element)
	}
	h.byID[id] = e
}

// ResponseHomes counts the stored responses whose upstream the fleet
// knows, its own and its peers'.
func (f *Fleet) ResponseHomes() int {
	h := &f.homes
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.order.Len()
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
