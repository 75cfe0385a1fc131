package router

import (
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
// it. Its order of use is a list linked by index through entries, so a
// response remembered allocates nothing of its own once the table is full
// (container/list allocated two objects a response).
type responseHomes struct {
	mu      sync.Mutex
	byID    map[string]int32 // the index of each id's entry
	entries []responseHome
	// newest and oldest are the most and the least recently used entries,
	// free the first unused one (linked by next); -1 when there is none.
	newest, oldest, free int32
	// limit is the most homes kept: MaxResponseHomes, or less in tests.
	limit int
}

// responseHome is an id's home, linked in the order of use: prev is the
// entry used next more recently, next the one used next less recently (-1
// at the ends).
type responseHome struct {
	id, dial   string
	prev, next int32
}

// RememberResponse notes that dial answered, and stored, the response id,
// and tells the peers (EventStored): the next request of the conversation
// may reach any router.
func (f *Fleet) RememberResponse(id, dial string) {
	if !f.homes.remember(id, dial) || !f.publishing.Load() {
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
	if i, ok := h.byID[id]; ok {
		h.unlink(i)
		h.pushNewest(i)
		news := h.entries[i].dial != dial
		h.entries[i].dial = dial
		return news
	}
	if len(h.byID) >= h.max() {
		h.drop(h.oldest)
	}
	h.pushNewest(h.add(id, dial))
	return true
}

// forget drops what is known of id's home.
func (h *responseHomes) forget(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if i, ok := h.byID[id]; ok {
		h.drop(i)
	}
}

// newestFirst returns the homes known, most recently used first.
func (h *responseHomes) newestFirst() []responseHome {
	h.mu.Lock()
	defer h.mu.Unlock()
	homes := make([]responseHome, 0, len(h.byID))
	for i := h.newest; len(homes) < len(h.byID); i = h.entries[i].next {
		homes = append(homes, responseHome{id: h.entries[i].id, dial: h.entries[i].dial})
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
	if _, ok := h.byID[id]; ok || len(h.byID) >= h.max() {
		return false
	}
	h.pushOldest(h.add(id, dial))
	return true
}

// max is the most homes kept.
func (h *responseHomes) max() int {
	if h.limit > 0 {
		return h.limit
	}
	return MaxResponseHomes
}

// validHome reports whether a home of id at dial may be remembered.
func validHome(id, dial string) bool {
	return id != "" && dial != "" && len(id) <= MaxResponseIDBytes
}

// add stores id's home in an unused entry, not linked yet, and returns
// its index. Caller holds h.mu.
func (h *responseHomes) add(id, dial string) int32 {
	if h.byID == nil {
		h.byID = make(map[string]int32)
		h.newest, h.oldest, h.free = -1, -1, -1
	}
	i := h.free
	if i >= 0 {
		h.free = h.entries[i].next
	} else {
		i = int32(len(h.entries))
		h.entries = append(h.entries, responseHome{})
	}
	h.entries[i] = responseHome{id: id, dial: dial, prev: -1, next: -1}
	h.byID[id] = i
	return i
}

// drop forgets entry i, linked, and keeps it for reuse. Caller holds h.mu.
func (h *responseHomes) drop(i int32) {
	h.unlink(i)
	delete(h.byID, h.entries[i].id)
	h.entries[i] = responseHome{prev: -1, next: h.free}
	h.free = i
}

// unlink takes entry i out of the order of use. Caller holds h.mu.
func (h *responseHomes) unlink(i int32) {
	e := &h.entries[i]
	if e.prev >= 0 {
		h.entries[e.prev].next = e.next
	} else {
		h.newest = e.next
	}
	if e.next >= 0 {
		h.entries[e.next].prev = e.prev
	} else {
		h.oldest = e.prev
	}
	e.prev, e.next = -1, -1
}

// pushNewest links entry i, unlinked, as the most recently used. Caller
// holds h.mu.
func (h *responseHomes) pushNewest(i int32) {
	h.entries[i].prev, h.entries[i].next = -1, h.newest
	if h.newest >= 0 {
		h.entries[h.newest].prev = i
	} else {
		h.oldest = i
	}
	h.newest = i
}

// pushOldest links entry i, unlinked, as the least recently used. Caller
// holds h.mu.
func (h *responseHomes) pushOldest(i int32) {
	h.entries[i].prev, h.entries[i].next = h.oldest, -1
	if h.oldest >= 0 {
		h.entries[h.oldest].next = i
	} else {
		h.newest = i
	}
	h.oldest = i
}

// ResponseHomes counts the stored responses whose upstream the fleet
// knows, its own and its peers'.
func (f *Fleet) ResponseHomes() int {
	h := &f.homes
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.byID)
}

// ResponseHome is the upstream that answered the stored response id, ""
// when the fleet does not know it.
func (f *Fleet) ResponseHome(id string) string {
	if id == "" {
		return ""
	}
	return f.homes.home(id)
}

// home returns id's home, "" when unknown, and marks it used.
func (h *responseHomes) home(id string) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	i, ok := h.byID[id]
	if !ok {
		return ""
	}
	h.unlink(i)
	h.pushNewest(i)
	return h.entries[i].dial
}
