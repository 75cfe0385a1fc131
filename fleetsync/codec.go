package fleetsync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// The wire format of one batch: a version byte, the sender's name and
// epoch, then the messages, each a kind byte and its fields. Integers are
// unsigned varints, strings a length and bytes, block hashes 8 bytes
// little-endian each. A batch carries hashes, counts and ids only: the
// fields below are all there is.
//
//	batch   = version(3 to 7) name epoch instance count message*
//	routed  = 1 id dial blockTokens prefill decode kv adapter n hash*n
//	progr.  = 2 id tokens
//	compl.  = 3 id model tokens promptBytes promptTokens
//	release = 4 id
//	stored  = 5 id dial response                 (version 4 on)
//	cached  = 6 id dial blockTokens kv adapter n hash*n  (version 6; 5 had no adapter)
//	forgot  = 7 id dial from n hash*n             (version 7 on)
//	prefill = 8 id dial at n hash*n               (version 7 on; at: unix nanos, 0 unknown)
//	drain   = 16 dial deadlineMillis
//	undrain = 17 dial
//
// A decoder rejects a batch with a kind it does not know, so a kind is
// added with a version, and the messages of the new kind travel in
// batches of their own: a router of the version before rejects those
// (the Responses API's stored responses, which it cannot use) and keeps
// reading the rest. Cached blocks travel only in the answers to a
// starting router's request for a snapshot, which routers of the versions
// before never ask for. Forgotten and prefilled blocks (version 7) travel
// in batches that carry no batch number (see Syncer.run): a router of the
// versions before rejects them and sees no gap in the numbers of the
// batches it reads. Version 2 is version 3 without a completion's
// prompt bytes and tokens; batches of every version from 2 decode, so
// routers of different versions share a view during a rolling upgrade as
// far as the older one can read.
const wireVersion = 7

// chargeWireVersion is the version of batches of charges and drains:
// version 3, which routers of two versions before read. Stored
// responses need storedWireVersion, cached blocks cachedWireVersion (and
// adapterWireVersion with an adapter), forgotten and prefilled blocks
// indexWireVersion.
const (
	chargeWireVersion  = 3
	storedWireVersion  = 4
	cachedWireVersion  = 5
	adapterWireVersion = 6
	indexWireVersion   = 7
)

// oldWireVersion is the oldest version DecodeBatch reads.
const oldWireVersion = 2

// Message kinds beyond the router's events.
const (
	kindDrain   = 16
	kindUndrain = 17
)

// Bounds a decoder enforces, so a hostile or corrupt batch costs little;
// Publish keeps within them.
const (
	maxString   = 1024
	maxHashes   = 1 << 16
	maxMessages = 1 << 16
)

// encodedSize bounds m's encoding, for keeping batches under the NATS
// payload limit: 64 bytes hold a message's kind, id, counts (5 bytes each
// at most) and string lengths; an operator's drain or undrain also takes
// its time in the batch's header (see setOpTimes), 21 bytes at most.
func encodedSize(m *Message) int {
	n := 64 + len(m.Drain) + len(m.Undrain)
	if m.opDial() != "" {
		n += 21
	}
	if ev := m.Event; ev != nil {
		n += len(ev.Dial) + len(ev.Adapter) + len(ev.Model) + len(ev.Response) + 8*len(ev.Hashes)
	}
	return n
}

// Message is one thing a router tells its peers: a change to its charges
// (Event) or an operator's drain or undrain of an upstream.
type Message struct {
	// Event is set for charge changes.
	Event *router.Event
	// Drain and Undrain name an upstream an operator drained (with
	// Deadline) or undrained through this router's admin API.
	Drain, Undrain string
	Deadline       time.Duration
	// seq orders an operator's messages within the sending router (see
	// Syncer.numberOp), and made is when the operator made it; they are
	// not sent. order places it among every router's drains and undrains
	// of the upstream (unix nanoseconds, 0 unknown; sent in
	// opTimesHeader): made, or just after the latest one known here when
	// that is later, as a peer's is when its clock runs fast.
	seq   uint64
	made  time.Time
	order int64
	// countedDropped marks a message kept to send again once connected
	// that events_dropped has counted: sending it again can fail too, and
	// it is one message lost for a while, not one for every try.
	countedDropped bool
}

// Batch is what one publication carries.
type Batch struct {
	// Sender is the router's name, Epoch when it started (unix nanos):
	// together they tell a restarted router from its earlier self.
	// Instance is the sending process's, so that two connections of one
	// process never apply each other's batches.
	Sender   string
	Epoch    uint64
	Instance uint64
	Messages []Message
}

// AppendBatch appends b's encoding to dst, in the oldest version that has
// all its kinds of message.
func AppendBatch(dst []byte, b *Batch) []byte {
	version := byte(chargeWireVersion)
	for i := range b.Messages {
		version = max(version, versionOf(&b.Messages[i]))
	}
	dst = append(dst, version)
	dst = appendString(dst, b.Sender)
	dst = binary.AppendUvarint(dst, b.Epoch)
	dst = binary.AppendUvarint(dst, b.Instance)
	dst = binary.AppendUvarint(dst, uint64(len(b.Messages)))
	for i := range b.Messages {
		dst = appendMessage(dst, &b.Messages[i])
	}
	return dst
}

// versionOf is the oldest wire version that has m's kind.
func versionOf(m *Message) byte {
	switch {
	case m.Event == nil:
		return chargeWireVersion
	case m.Event.Kind == router.EventStored:
		return storedWireVersion
	case m.Event.Kind == router.EventCached:
		return adapterWireVersion
	case isIndexEvent(m.Event.Kind):
		return indexWireVersion
	}
	return chargeWireVersion
}

func appendMessage(dst []byte, m *Message) []byte {
	switch {
	case m.Event != nil:
		ev := m.Event
		dst = append(dst, byte(ev.Kind))
		dst = binary.AppendUvarint(dst, ev.ID)
		switch ev.Kind {
		case router.EventRouted:
			dst = appendString(dst, ev.Dial)
			for _, n := range []int{ev.BlockTokens, ev.Prefill, ev.Decode, ev.KV} {
				dst = appendCount(dst, n)
			}
			dst = appendString(dst, ev.Adapter)
			dst = appendHashes(dst, ev.Hashes)
		case router.EventCached:
			dst = appendString(dst, ev.Dial)
			dst = appendCount(dst, ev.BlockTokens)
			dst = appendCount(dst, ev.KV)
			dst = appendString(dst, ev.Adapter)
			dst = appendHashes(dst, ev.Hashes)
		case router.EventProgressed:
			dst = appendCount(dst, ev.Tokens)
		case router.EventCompleted:
			dst = appendString(dst, ev.Model)
			for _, n := range []int{ev.Tokens, ev.PromptBytes, ev.PromptTokens} {
				dst = appendCount(dst, n)
			}
		case router.EventStored:
			dst = appendString(dst, ev.Dial)
			dst = appendString(dst, ev.Response)
		case router.EventForgot:
			dst = appendString(dst, ev.Dial)
			dst = appendCount(dst, ev.From)
			dst = appendHashes(dst, ev.Hashes)
		case router.EventPrefilled:
			dst = appendString(dst, ev.Dial)
			var at uint64
			if !ev.At.IsZero() {
				at = uint64(max(0, ev.At.UnixNano()))
			}
			dst = binary.AppendUvarint(dst, at)
			dst = appendHashes(dst, ev.Hashes)
		}
	case m.Drain != "":
		dst = append(dst, kindDrain)
		dst = appendString(dst, m.Drain)
		dst = binary.AppendUvarint(dst, uint64(max(0, m.Deadline.Milliseconds())))
	default:
		dst = append(dst, kindUndrain)
		dst = appendString(dst, m.Undrain)
	}
	return dst
}

// isIndexEvent reports whether events of kind change only what the
// peers' prefix indexes hold (see indexWireVersion).
func isIndexEvent(kind router.EventKind) bool {
	return kind == router.EventForgot || kind == router.EventPrefilled
}

// appendCount appends n bounded to what a decoder accepts (0 to
// MaxInt32): an absurd figure an engine reported must not make every peer
// reject the whole batch, and the releases in it.
func appendCount(dst []byte, n int) []byte {
	return binary.AppendUvarint(dst, uint64(min(max(0, n), math.MaxInt32)))
}

func appendHashes(dst []byte, hashes []uint64) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(hashes)))
	for _, h := range hashes {
		dst = binary.LittleEndian.AppendUint64(dst, h)
	}
	return dst
}

func appendString(dst []byte, s string) []byte {
	s = s[:min(len(s), maxString)]
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// errMalformed is the error of every batch that does not decode.
var errMalformed = errors.New("fleetsync: malformed batch")

// decoder reads a batch; the first error sticks.
type decoder struct {
	b       []byte
	err     error
	version byte
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", errMalformed, what)
	}
}

func (d *decoder) byte() byte {
	if d.err != nil || len(d.b) == 0 {
		d.fail("truncated")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

// int reads a count that must fit an int32, as every count here does.
func (d *decoder) int() int {
	v := d.uvarint()
	if v > math.MaxInt32 {
		d.fail("count out of range")
		return 0
	}
	return int(v)
}

// hashes reads a count and that many block hashes.
func (d *decoder) hashes() []uint64 {
	n := d.uvarint()
	if d.err == nil && (n > maxHashes || n*8 > uint64(len(d.b))) {
		d.fail("bad hash count")
	}
	if d.err != nil {
		return nil
	}
	hashes := make([]uint64, n)
	for i := range hashes {
		hashes[i] = binary.LittleEndian.Uint64(d.b[8*i:])
	}
	d.b = d.b[8*n:]
	return hashes
}

func (d *decoder) string() string {
	n := d.uvarint()
	if d.err != nil {
		return ""
	}
	if n > maxString || n > uint64(len(d.b)) {
		d.fail("bad string length")
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

// DecodeBatch decodes one batch. It never panics; anything malformed is an
// error and nothing of the batch is returned.
func DecodeBatch(p []byte) (*Batch, error) {
	d := &decoder{b: p}
	v := d.byte()
	if d.err == nil && (v < oldWireVersion || v > wireVersion) {
		return nil, fmt.Errorf("%w: version %d", errMalformed, v)
	}
	d.version = v
	b := &Batch{Sender: d.string(), Epoch: d.uvarint(), Instance: d.uvarint()}
	count := d.uvarint()
	if count > maxMessages || count > uint64(len(d.b)) {
		d.fail("too many messages")
	}
	if d.err != nil {
		return nil, d.err
	}
	b.Messages = make([]Message, 0, count)
	for range count {
		m, ok := d.message()
		if !ok {
			return nil, d.err
		}
		b.Messages = append(b.Messages, m)
	}
	if d.err == nil && len(d.b) > 0 {
		d.fail("trailing bytes")
	}
	if d.err != nil {
		return nil, d.err
	}
	return b, nil
}

func (d *decoder) message() (Message, bool) {
	var m Message
	switch kind := d.byte(); kind {
	case byte(router.EventCached):
		if d.version < cachedWireVersion {
			d.fail(fmt.Sprintf("cached blocks in a version %d batch", d.version))
			break
		}
		ev := &router.Event{Kind: router.EventCached, ID: d.uvarint(), Dial: d.string()}
		ev.BlockTokens, ev.KV = d.int(), d.int()
		if d.version >= adapterWireVersion {
			ev.Adapter = d.string()
		}
		ev.Hashes = d.hashes()
		if d.err == nil && ev.Dial == "" {
			d.fail("cached blocks without a dial")
		}
		m.Event = ev
	case byte(router.EventStored):
		if d.version < storedWireVersion {
			d.fail(fmt.Sprintf("a stored response in a version %d batch", d.version))
			break
		}
		m.Event = &router.Event{Kind: router.EventStored, ID: d.uvarint(), Dial: d.string(), Response: d.string()}
		if d.err == nil && (m.Event.Dial == "" || m.Event.Response == "") {
			d.fail("stored response without a dial or an id")
		}
	case byte(router.EventForgot), byte(router.EventPrefilled):
		if d.version < indexWireVersion {
			d.fail(fmt.Sprintf("forgotten or prefilled blocks in a version %d batch", d.version))
			break
		}
		ev := &router.Event{Kind: router.EventKind(kind), ID: d.uvarint(), Dial: d.string()}
		switch ev.Kind {
		case router.EventForgot:
			ev.From = d.int()
		case router.EventPrefilled:
			if at := d.uvarint(); at > math.MaxInt64 {
				d.fail("time out of range")
			} else if at > 0 {
				ev.At = time.Unix(0, int64(at))
			}
		}
		ev.Hashes = d.hashes()
		if d.err == nil && ev.Dial == "" {
			d.fail("forgotten or prefilled blocks without a dial")
		}
		m.Event = ev
	case byte(router.EventRouted), byte(router.EventProgressed), byte(router.EventCompleted), byte(router.EventReleased):
		ev := &router.Event{Kind: router.EventKind(kind), ID: d.uvarint()}
		switch ev.Kind {
		case router.EventRouted:
			ev.Dial = d.string()
			ev.BlockTokens, ev.Prefill, ev.Decode, ev.KV = d.int(), d.int(), d.int(), d.int()
			ev.Adapter = d.string()
			ev.Hashes = d.hashes()
		case router.EventProgressed:
			ev.Tokens = d.int()
		case router.EventCompleted:
			ev.Model, ev.Tokens = d.string(), d.int()
			if d.version >= 3 {
				ev.PromptBytes, ev.PromptTokens = d.int(), d.int()
			}
		}
		m.Event = ev
	case kindDrain:
		m.Drain = d.string()
		ms := d.uvarint()
		if ms > uint64(math.MaxInt64/int64(time.Millisecond)) {
			d.fail("deadline out of range")
		}
		m.Deadline = time.Duration(ms) * time.Millisecond
		if d.err == nil && m.Drain == "" {
			d.fail("drain without a dial")
		}
	case kindUndrain:
		m.Undrain = d.string()
		if d.err == nil && m.Undrain == "" {
			d.fail("undrain without a dial")
		}
	default:
		d.fail(fmt.Sprintf("unknown kind %d", kind))
	}
	return m, d.err == nil
}
