// Package fleetsync shares routing events between routers over NATS, so
// that several gateways in front of the same upstreams share one view:
// each publishes the changes to its own charges (package router's Event)
// and operators' drains, in compact batches, and applies its peers'.
//
// Nothing here is on a request's path: Publish only queues (bounded; a
// full queue drops and counts), a goroutine of the Syncer batches and
// publishes, and NATS delivers peers' batches on its own goroutine. When
// NATS is unreachable the router keeps routing on its own view, the loss
// is logged once and counted, and the client reconnects for ever; events
// of the outage are dropped rather than replayed late. Once connected
// again, a router that lost messages renews its identity (a new epoch:
// its peers drop what they counted under the old one when they hear the
// new one, see Config.OnSuperseded) and restates its live charges
// (Config.Resync) and the operators' drains it could not send; its peers
// restate theirs to it, as they do to a router they hear for the first
// time or again after a silence. A router that starts asks one peer for a
// snapshot of what outlives charges (Config.Snapshot: the prefix index,
// stored responses' homes, drains in force), so that it does not start
// cold. It knows nothing of Caddy.
package fleetsync

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// Defaults.
const (
	DefaultSubject           = "llm_affinity"
	DefaultQueueLength       = 8192
	DefaultHeartbeatInterval = time.Second
	// closeFlushTimeout bounds how long Close waits for buffered
	// messages to reach the server.
	closeFlushTimeout = 500 * time.Millisecond
	// writeTimeout bounds a write to the server: past it the client
	// treats the connection as lost and reconnects. nats.go's default, a
	// minute, would hold the publisher (and the client's lock) that long
	// on a network path that silently stalls.
	writeTimeout = 2 * time.Second
	// pingInterval and maxPingsOutstanding find a server that stopped
	// answering while the connection stays open (a frozen process, whose
	// socket buffers take megabytes of writes without a timeout): within
	// about three intervals the client counts it lost and reconnects,
	// rather than at nats.go's default of two minutes, and the outage's
	// messages are dropped rather than delivered late.
	pingInterval        = 2 * time.Second
	maxPingsOutstanding = 2
	// renewInterval is the least time between two renewals of the
	// router's identity after lost messages, each of which restates every
	// charge in flight: a queue that overflows for good must not turn
	// into a stream of restatements.
	renewInterval = 5 * time.Second
	// senderMemory is how long a peer's latest name is remembered after
	// its last batch, to tell its later names from its earlier ones.
	senderMemory = time.Minute
	// maxBatch is how many messages one publication carries at most, and
	// maxBatchBytes how many bytes: well under NATS's default payload
	// limit (1 MB), so a burst of long prompts never makes a publication
	// fail and take unrelated releases with it. A server whose limit is
	// lower gets batches within its own (see batchBytes).
	maxBatch      = 256
	maxBatchBytes = 256 << 10
	// batchHeadroom is what a publication carries besides its messages'
	// encodedSize, less the sender's name: the batch's epoch and instance
	// and the NATS headers (batch number, protocol framing).
	batchHeadroom = 256
)

// batchBytes bounds the encoded messages of one publication: maxBatchBytes,
// or less to stay within the payload limit of the server connected to
// (nats.go refuses a larger publication outright, and its events would be
// lost). A message larger than that still goes alone, and the server
// refuses it only if it exceeds the server's limit itself.
func (s *Syncer) batchBytes() int {
	limit := maxBatchBytes
	if payload := s.maxPayload.Load(); payload > 0 {
		limit = min(limit, int(payload)-batchHeadroom-len(s.cfg.Name))
	}
	return max(limit, 1)
}

// batchFull says a batch of count messages in size bytes must be sent
// before a message of n bytes joins it: it has maxBatch, or would go
// past limit (see batchBytes). An empty batch takes any message.
func batchFull(count, size, n, limit int) bool {
	return count > 0 && (size+n > limit || count >= maxBatch)
}

// notePayloadLimit notes the payload limit of the server nc has just
// connected to, for batchBytes; asked of the client at each connection,
// since it takes the client's lock, which a reconnection holds.
func (s *Syncer) notePayloadLimit(nc *nats.Conn) { s.maxPayload.Store(nc.MaxPayload()) }

// MaxEventHashes caps the block hashes one event carries (64 KB; 512k
// tokens at 64-token blocks): a routed event's peers learn the prefix,
// the part that matters, and a snapshot sends an index in events of this
// many.
const MaxEventHashes = 8192

// maxEventBytes is about the largest one message takes in a batch: a
// routed event with MaxEventHashes hashes and its strings.
const maxEventBytes = 8*MaxEventHashes + 4*maxString + 64 + batchHeadroom

// Config configures a Syncer. Zero values take the defaults.
type Config struct {
	// URLs are the NATS servers, nats://host:port (tls:// for TLS).
	URLs []string
	// Subject is the NATS subject; routers sharing a subject share a view.
	// Default DefaultSubject.
	Subject string
	// Name identifies this router to its peers. Default: the host name and
	// process id.
	Name string
	// Creds is a NATS credentials file (JWT and seed).
	Creds string
	// TLSCA is a PEM file of the certificate authorities that sign the NATS
	// servers' certificates.
	TLSCA string
	// QueueLength bounds the messages waiting to be published; a full
	// queue drops (and counts) new ones. Default DefaultQueueLength.
	QueueLength int
	// PendingBytes bounds the peers' batches received and not yet
	// applied; past it the NATS client drops them, and the router renews
	// to have its peers restate (see Stats.Missed). Default: nats.go's,
	// 64 MiB.
	PendingBytes int
	// ConnectTimeout bounds one connection attempt to one server. Default:
	// nats.go's, 2 seconds.
	ConnectTimeout time.Duration
	// HeartbeatInterval is how often an idle router tells its peers it is
	// alive (an empty batch). Default
	// DefaultHeartbeatInterval.
	HeartbeatInterval time.Duration
	// OnMessage receives each message of a peer's batch, in order, on the
	// Syncer's receiving goroutine. peer names the sending router
	// (Name#epoch, so a restarted router is a new peer).
	OnMessage func(peer string, m Message)
	// OnHeard receives every batch's sender, before its messages.
	OnHeard func(peer string)
	// OnRenewed is called when this router takes a new name after its
	// connection was lost, before it restates its charges, with the
	// names of the peers this connection heard: what it counted of their
	// charges may miss releases of the outage, so it drops them, and they
	// restate theirs when they hear the new name. Called on the
	// publishing goroutine; optional.
	OnRenewed func(peers []string)
	// Snapshot restates, for a router that starts, what this one knows
	// that outlives any charge: the operators' drains in force, its
	// prefix index and the stored responses' homes (messages whose events
	// are EventCached and EventStored). A starting router asks one of its
	// peers for it; this router answers only with Snapshot set. Called on
	// the goroutine that answers; optional.
	Snapshot func() []Message
	// OnSnapshot receives, in order, the messages of the snapshot this
	// router starts with (a peer's Snapshot), on a goroutine of its own;
	// without it the router asks for none. An operator's drain in it is
	// left out when a drain or undrain of the same upstream arrived live
	// since the snapshot was asked for: that one is newer.
	OnSnapshot func(peer string, m Message)
	// OnSuperseded receives a peer's earlier name when the peer is first
	// heard under a later one (the same router, which lost messages and
	// restates its charges under the new name): what the earlier name
	// holds is to be dropped at once. A late batch of an earlier name is
	// ignored.
	OnSuperseded func(peer string)
	// Resync returns messages that restate this router's live state (its
	// charges in flight). They are published first on a new connection
	// and under the router's new identity after messages were lost, so
	// that its peers, which drop the old identity's charges, count what
	// is still in flight. Called on the publishing goroutine; optional.
	Resync func() []Message
	// Instance names the routing state this connection serves: the
	// connections of one router (several sync configurations in one
	// process) share it and never apply each other's batches, whatever
	// their names. Default: a random value of this Syncer's own.
	Instance uint64
	// Logger receives connection losses and recoveries.
	Logger *zap.Logger
}

// Stats are a Syncer's counters.
type Stats struct {
	Name      string `json:"name"`
	Subject   string `json:"subject"`
	Connected bool   `json:"connected"`
	// Sent counts messages published; Applied, peers' messages received
	// and handed to OnMessage; Dropped, messages lost to a full queue or
	// an unreachable NATS, each once (an operator's drain or a failed
	// request's forget kept and sent once connected counts too, and not
	// again when a try to send it fails); Malformed, batches that did
	// not decode.
	Sent        uint64 `json:"events_sent"`
	Applied     uint64 `json:"events_applied"`
	Dropped     uint64 `json:"events_dropped"`
	Malformed   uint64 `json:"batches_malformed"`
	Disconnects uint64 `json:"disconnects"`
	// Renewals counts the new identities taken after lost messages;
	// Stale, peers' batches under a name they had replaced, delivered
	// late and ignored; Missed, the times peers' batches were lost on the
	// way while the connection stayed up (a gap in a peer's numbering: a
	// route between NATS servers broke; or the client dropped them, this
	// router reading too slowly), each followed by a renewal.
	Renewals uint64 `json:"renewals"`
	Stale    uint64 `json:"batches_stale"`
	Missed   uint64 `json:"batches_missed"`
	// OpsSuperseded counts peers' drains and undrains ignored because one
	// of the same upstream made later was known here already (a stale
	// one restated after a partition).
	OpsSuperseded uint64 `json:"ops_superseded"`
	// Retired says a newer connection of this router publishes in its
	// place (see Replaces) until it is closed.
	Retired bool `json:"retired,omitempty"`
	// LastError is why the last attempt to connect failed, while not
	// connected ("" once connected): a refused connection, a name that
	// does not resolve, a certificate NATS's TLS refused.
	LastError string `json:"last_error,omitempty"`
	// LastReceived is when the last peer batch arrived (zero: never).
	LastReceived time.Time `json:"last_received,omitzero"`
	// SnapshotFrom names the peer whose snapshot this router started
	// with ("" when none answered: it started first, or its peers are of
	// a version without snapshots), and SnapshotMessages counts its
	// messages; SnapshotsSent counts the snapshots this router gave
	// routers that started.
	SnapshotFrom     string `json:"snapshot_from,omitempty"`
	SnapshotMessages uint64 `json:"snapshot_messages"`
	SnapshotsSent    uint64 `json:"snapshots_sent"`
}

// Syncer publishes this router's messages and receives its peers'.
type Syncer struct {
	cfg Config
	// epoch is the identity's, changed by the publisher only (renew);
	// self is Name#epoch, read by Name and Stats.
	epoch atomic.Uint64
	self  atomic.Pointer[string]
	// up is closed once the first connection is made; closed, once the
	// client's last callback (its closed handler) has run.
	up         chan struct{}
	upOnce     sync.Once
	closed     chan struct{}
	closedOnce sync.Once
	// warnedSameName says a peer with this router's name was logged.
	warnedSameName atomic.Bool
	// connErr is why the last attempt to connect failed, "" once
	// connected (see noteConnError).
	connErrMu      sync.Mutex
	connErr        string
	connErrsLogged loggedReasons // since the last connection
	// mu orders Close with connect's hand-over of the connection: nc is
	// set under it, once, unless Close came first.
	mu    sync.Mutex
	nc    *nats.Conn
	queue chan Message
	// live says the publisher runs: Publish drops (and counts) until then.
	live atomic.Bool
	stop chan struct{}
	done chan struct{}
	once sync.Once

	sent, applied, dropped, malformed, disconnects, renewals, stale, missed, opsSuperseded atomic.Uint64
	lastReceived                                                                           atomic.Int64
	snapshotFrom                                                                           atomic.Pointer[string]
	snapshotMessages, snapshotsSent                                                        atomic.Uint64
	// lost says a charge's routing or release may not have reached the
	// peers (dropped, or sent on a connection that died): their view of
	// this router's charges is wrong until it renews its identity.
	// restate says the charges in flight are to be restated under the
	// current one (a new connection).
	lost, restate atomic.Bool
	// restateOps says this router's operators' latest drains and undrains
	// are to be restated too: a peer renewed (it missed batches), or was
	// heard again after a silence. (A peer heard for the first time has
	// them from its snapshot.)
	restateOps atomic.Bool
	// lostOps are the operators' drains and undrains that could not be
	// sent, the latest per upstream, sent once connected. opSeq numbers
	// operators' messages, and keptSeq is the number of the latest one
	// kept per upstream: an earlier one still queued must not follow it.
	opsMu   sync.Mutex
	lostOps map[string]Message
	opSeq   uint64
	keptSeq map[string]uint64
	// lostForgets are the failed requests' forgets (EventForgot) that
	// could not be sent while disconnected (see unsent), in order, within
	// maxLostForgetHashes hashes (lostForgetHashes), sent once connected:
	// nothing else makes the peers forget what those requests' routings
	// added to their indexes (a renewal's restatement carries no hashes).
	lostForgets      []Message
	lostForgetHashes int
	// lostStored are the stored responses' homes (EventStored) that could
	// not be sent, at most maxLostStored, sent once connected: a peer that
	// never hears of one sends the response's next turn by its input
	// alone, to an engine that answers 404, and no later traffic tells it.
	lostStored []Message
	// ownOps are this router's operators' latest drain or undrain per
	// upstream that no peer's later one replaced: restated with the
	// charges, since a peer may have missed it without either side
	// losing its connection.
	ownOps map[string]Message
	// opAt is when the latest drain or undrain of each upstream known
	// here (this router's or a peer's) was made, unix nanoseconds.
	opAt map[string]int64
	// senders is each peer router's latest name (by the Instance and
	// name of its batches), written by the receiving goroutine.
	sendersMu   sync.Mutex
	senders     map[senderKey]senderName
	sendersSeen time.Time
	// maxPayload is the payload limit of the server last connected to,
	// 0 before the first connection (see batchBytes).
	maxPayload atomic.Int64
	// cut says the connection was lost since the last renewal.
	cut atomic.Bool
	// missedWarned says missedBatches warned since the last renewal: a
	// router that reads too slowly misses batches at every turn, and
	// the renewal that makes them good comes at most every
	// renewInterval.
	missedWarned atomic.Bool
	// asyncErrsLogged are the errors the client reported to the error
	// handler that were logged on this connection (see warnAsyncError).
	asyncErrMu      sync.Mutex
	asyncErrsLogged loggedReasons
	// badHeaderWarned says a message whose headers did not decode was
	// logged: the first only.
	badHeaderWarned atomic.Bool
	// liveOps, while a snapshot is being applied (non-nil), holds the
	// upstreams whose drains or undrains arrived live meanwhile, and
	// liveForgot the blocks failed requests made the routers forget
	// meanwhile, by upstream (liveForgotten counts them, within
	// maxLiveForgot).
	liveOpsMu     sync.Mutex
	liveOps       map[string]bool
	liveForgot    map[string]map[uint64]struct{}
	liveForgotten int
	// retired says a newer connection publishes for this one (see
	// Replaces).
	retired atomic.Bool
	// connected follows the connection's handlers, so that Stats never
	// asks the client, whose lock a write stuck on a stalled network
	// holds.
	connected atomic.Bool
}

// New returns a Syncer for cfg; Start connects it.
func New(cfg Config) (*Syncer, error) {
	if len(cfg.URLs) == 0 {
		return nil, fmt.Errorf("fleetsync: no NATS server URL")
	}
	if cfg.Subject == "" {
		cfg.Subject = DefaultSubject
	}
	if cfg.Name == "" {
		host, _ := os.Hostname()
		cfg.Name = host + "-" + strconv.Itoa(os.Getpid())
	}
	if cfg.QueueLength <= 0 {
		cfg.QueueLength = DefaultQueueLength
	}
	if cfg.HeartbeatInterval <= 0 {
		cfg.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Instance == 0 {
		cfg.Instance = rand.Uint64() | 1
	}
	s := &Syncer{
		cfg:   cfg,
		queue: make(chan Message, cfg.QueueLength),
		stop:  make(chan struct{}), done: make(chan struct{}), up: make(chan struct{}), closed: make(chan struct{}),
	}
	s.epoch.Store(uint64(time.Now().UnixNano()))
	self := peerName(cfg.Name, s.epoch.Load())
	s.self.Store(&self)
	return s, nil
}

func peerName(name string, epoch uint64) string { return name + "#" + strconv.FormatUint(epoch, 10) }

// senderKey names a peer router across its renewals; senderName is its
// latest epoch and when it was last heard.
type senderKey struct {
	instance uint64
	name     string
}

type senderName struct {
	epoch uint64
	heard time.Time
	// seq is the number of its last batch under epoch (see seqHeader), 0
	// when unnumbered (a router of a version before, or only index
	// batches heard so far).
	seq uint64
}

// opTimesHeader gives, in order, when each operator's drain or undrain in
// the batch was made (unix nanoseconds, comma-separated; 0 unknown), so
// that a drain restated after a partition never undoes an undrain made
// later through another router. Routers of the versions before send
// none: their ops apply as they come.
const opTimesHeader = "Llm-Affinity-Op-Times"

// seqHeader numbers the batches one connection publishes, heartbeats
// included, 1, 2, 3...: a receiver that sees a number skipped lost
// batches while both stayed connected (a route between NATS servers that
// broke and healed, or a subscription the client dropped messages of),
// which no disconnection tells either side. A header, which routers of
// the versions before ignore, where a field in the batch would make them
// reject it. Batches of index changes go unnumbered (see Syncer.run),
// so a lost one goes unnoticed: its peers' indexes are wrong until the
// blocks are routed again or evicted.
const seqHeader = "Llm-Affinity-Seq"

// Name is this router's name as its peers see it.
func (s *Syncer) Name() string { return *s.self.Load() }

// Start checks the configuration and starts connecting to NATS in the
// background: it never waits on the network (a Caddy reload must not
// stall on an unreachable server), and an unreachable NATS is no error:
// the client keeps trying. A wrong server URL, or a credentials or CA
// file that cannot be read, is an error.
func (s *Syncer) Start() error {
	opts, err := s.options()
	if err != nil {
		return err
	}
	go s.connect(opts)
	return nil
}

// options returns the NATS client's options, checked as far as they can
// be without connecting.
func (s *Syncer) options() ([]nats.Option, error) {
	log := s.cfg.Logger
	websockets := 0
	for _, u := range s.cfg.URLs {
		if !strings.Contains(u, "://") {
			u = "nats://" + u
		}
		parsed, err := url.Parse(u)
		if err != nil || parsed.Host == "" {
			return nil, fmt.Errorf("fleetsync: NATS server URL %q: want nats://host:port (or tls://)", withoutUserInfoOf(u))
		}
		switch parsed.Scheme {
		case "nats", "tls", "ws", "wss":
		default:
			// nats.go would connect as to nats:// whatever the scheme:
			// http:// is surely a mistake (NATS's monitoring port?).
			return nil, fmt.Errorf("fleetsync: NATS server URL %q: scheme %q is not NATS's: want nats://, tls://, ws:// or wss://",
				withoutUserInfoOf(u), parsed.Scheme)
		}
		if parsed.Scheme == "ws" || parsed.Scheme == "wss" {
			websockets++
		}
	}
	if websockets > 0 && websockets < len(s.cfg.URLs) {
		return nil, fmt.Errorf("fleetsync: NATS server URLs mix websocket (ws://, wss://) and other schemes")
	}
	if !validSubject(s.cfg.Subject) {
		return nil, fmt.Errorf("fleetsync: subject %q: want dot-separated tokens without spaces or wildcards, e.g. llm_affinity.pool-a", s.cfg.Subject)
	}
	opts := []nats.Option{
		nats.Name("caddy-llm-affinity " + s.cfg.Name),
		nats.NoEcho(),
		nats.MaxReconnects(-1),
		// Also after the server refused the credentials twice (nats.go
		// gives up then): a fix on the server takes effect without a
		// reload of every router.
		nats.IgnoreAuthErrorAbort(),
		nats.ReconnectWait(time.Second),
		nats.RetryOnFailedConnect(true),
		// Events of an outage are dropped, not replayed late.
		nats.ReconnectBufSize(-1),
		nats.FlusherTimeout(writeTimeout),
		nats.PingInterval(pingInterval),
		nats.MaxPingsOutstanding(maxPingsOutstanding),
		nats.ConnectHandler(func(nc *nats.Conn) { // a first connection made late
			s.notePayloadLimit(nc)
			s.connected.Store(true)
			s.noteConnError(nil)
			s.markUp()
		}),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) { s.noteConnError(err) }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			s.connected.Store(false)
			select {
			case <-s.stop:
				return // this router closed it: a reload or a shutdown, no outage
			default:
			}
			s.disconnects.Add(1)
			// What was written to the dead connection may never have
			// reached the server, nor what peers sent meanwhile this
			// router.
			s.lost.Store(true)
			s.cut.Store(true)
			// Peers' batches of the outage are lost, which the renewal
			// makes good: the gap in their numbers is no other loss.
			s.forgetSeqs()
			log.Warn("lost the NATS connection; routing on this router's own view until it is back", zap.Error(err))
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			s.forgetSeqs() // also what a batch read as the connection dropped left
			s.asyncErrMu.Lock()
			s.asyncErrsLogged = nil // a new connection's errors are news
			s.asyncErrMu.Unlock()
			s.notePayloadLimit(nc) // the server may be another
			s.connected.Store(true)
			s.noteConnError(nil)
			log.Info("NATS connection back; sharing routing events again", zap.String("server", nc.ConnectedUrlRedacted()))
		}),
		nats.ClosedHandler(func(*nats.Conn) { s.connected.Store(false); s.closedOnce.Do(func() { close(s.closed) }) }),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrSlowConsumer) {
				// The client dropped peers' batches this router did not
				// read in time: their charges and releases are lost here.
				s.missedBatches("this router read the peers' batches too slowly; the NATS client dropped some")
				return
			}
			if errors.Is(err, nats.ErrBadHeaderMsg) {
				// The client passed the message on all the same, and
				// receive counts it malformed unless its batch decodes;
				// a line for each would let whoever may publish on the
				// subject fill the log.
				if !s.badHeaderWarned.Swap(true) {
					log.Warn("a message on the sync subject had NATS headers that do not decode (further ones are not logged)", zap.Error(err))
				}
				return
			}
			if isAuthError(err) {
				// Refused credentials, reported at every attempt once a
				// connection was made before: a reason to connect, logged
				// once an outage.
				s.noteConnError(err)
				return
			}
			if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), "_INBOX.") {
				// A reply refused: most often a snapshot's part beyond
				// the one reply `allow_responses: true` allows.
				s.warnAsyncError(err, zap.String("hint", snapshotPermissionHint))
				return
			}
			s.warnAsyncError(err)
		}),
	}
	if s.cfg.ConnectTimeout > 0 {
		opts = append(opts, nats.Timeout(s.cfg.ConnectTimeout))
	}
	if s.cfg.Creds != "" {
		// The client reads it when it connects; read it now too, so a
		// wrong path fails the configuration rather than every attempt.
		if _, err := os.ReadFile(s.cfg.Creds); err != nil {
			return nil, fmt.Errorf("fleetsync: NATS credentials: %w", err)
		}
		opts = append(opts, nats.UserCredentials(s.cfg.Creds))
	}
	if s.cfg.TLSCA != "" {
		opts = append(opts, nats.RootCAs(s.cfg.TLSCA))
	}
	// Applying the options loads the CA file, as connecting would; the
	// credentials' callbacks parse their JWT and seed.
	check := nats.GetDefaultOptions()
	for _, o := range opts {
		if err := o(&check); err != nil {
			return nil, fmt.Errorf("fleetsync: NATS options: %w", err)
		}
	}
	if check.UserJWT != nil {
		if _, err := check.UserJWT(); err != nil {
			return nil, fmt.Errorf("fleetsync: NATS credentials %s: %w", s.cfg.Creds, err)
		}
	}
	if check.SignatureCB != nil {
		if _, err := check.SignatureCB([]byte("check")); err != nil {
			return nil, fmt.Errorf("fleetsync: NATS credentials %s: %w", s.cfg.Creds, err)
		}
	}
	return opts, nil
}

// noteConnError records why the last attempt to connect to NATS failed
// (nil: connected), for Stats.LastError, and logs each new reason once:
// the client tries every second, and a bad certificate or a wrong address
// is not worth a line a second.
func (s *Syncer) noteConnError(err error) {
	s.connErrMu.Lock()
	defer s.connErrMu.Unlock()
	if err == nil {
		s.connErr, s.connErrsLogged = "", nil
		return
	}
	if errors.Is(err, nats.ErrNoServers) {
		// The client's word for a round of attempts that all failed: the
		// attempts' own reasons say more.
		if s.connErr == "" {
			s.connErr = err.Error()
		}
		return
	}
	s.connErr = err.Error()
	// The same reason from each of several servers is one reason.
	reason := s.connErr
	if op := (*net.OpError)(nil); errors.As(err, &op) && op.Err != nil {
		reason = op.Op + ": " + op.Err.Error()
	}
	reason = strings.ToLower(reason) // the client spells one refusal two ways
	if !s.connErrsLogged.first(reason) {
		return
	}
	s.cfg.Logger.Warn("cannot connect to NATS; routing on this router's own view while the client keeps trying", zap.Error(err))
}

// warnAsyncError logs an error the client reports to no caller, once for
// each reason a connection: the server refuses each publication a
// permission denies (a NATS user's typo refused every batch, a line each,
// over a thousand a second), while the connection stays up.
func (s *Syncer) warnAsyncError(err error, fields ...zap.Field) {
	s.asyncErrMu.Lock()
	first := s.asyncErrsLogged.first(err.Error())
	s.asyncErrMu.Unlock()
	if first {
		s.cfg.Logger.Warn("NATS error", append([]zap.Field{zap.Error(err)}, fields...)...)
	}
}

// isAuthError says err is the server refusing this router's credentials.
func isAuthError(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired)
}

// maxConnErrsLogged bounds the reasons logged in one outage.
const maxConnErrsLogged = 8

// loggedReasons are the reasons of errors logged, each once, at most
// maxConnErrsLogged of them (nil: none yet).
type loggedReasons []string

// first notes reason and says it is to be logged: not logged before, and
// within the bound.
func (l *loggedReasons) first(reason string) bool {
	if slices.Contains(*l, reason) || len(*l) >= maxConnErrsLogged {
		return false
	}
	*l = append(*l, reason)
	return true
}

// watchConnErrors reads why nc cannot connect while it is not connected,
// every connErrorPoll, for what the client reports to no handler: a TLS
// handshake or a server's greeting that failed after the connection was
// made (a certificate refused). On a goroutine of its own: the client
// holds its lock through each attempt, which the read waits for.
func (s *Syncer) watchConnErrors(nc *nats.Conn) {
	tick := time.NewTicker(connErrorPoll)
	defer tick.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
		if !s.connected.Load() {
			if err := nc.LastError(); err != nil {
				s.noteConnError(err)
			}
		}
	}
}

// connErrorPoll is how often watchConnErrors looks, about as often as the
// client tries (nats.ReconnectWait).
const connErrorPoll = time.Second

// validSubject reports whether subject is one a router can publish and
// subscribe to: dot-separated, non-empty tokens, no whitespace, no
// wildcards.
func validSubject(subject string) bool {
	if subject == "" || strings.ContainsAny(subject, " \t\r\n") {
		return false
	}
	for tok := range strings.SplitSeq(subject, ".") {
		if tok == "" || tok == "*" || tok == ">" {
			return false
		}
	}
	return true
}

// withoutUserInfo is urls, each without the credentials it may carry
// (see withoutUserInfoOf), for the logs.
func withoutUserInfo(urls []string) []string {
	out := make([]string, len(urls))
	for i, u := range urls {
		out[i] = withoutUserInfoOf(u)
	}
	return out
}

// withoutUserInfoOf is a NATS server URL, or a comma-separated list of
// them as nats.go takes it, with the user and password (or token) each
// may carry replaced: whatever comes before the host's last @, whatever
// characters it holds.
func withoutUserInfoOf(entry string) string {
	parts := strings.Split(entry, ",")
	for i, part := range parts {
		scheme, rest := "", part
		if k := strings.Index(part, "://"); k >= 0 {
			scheme, rest = part[:k+3], part[k+3:]
		}
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			rest = "redacted@" + rest[at+1:]
		}
		parts[i] = scheme + rest
	}
	return strings.Join(parts, ",")
}

// connect connects to NATS, subscribes and runs the publisher until Close.
// It runs on its own goroutine and owns the connection: a Close while it
// still connects makes it close the connection as soon as it has one.
func (s *Syncer) connect(opts []nats.Option) {
	log := s.cfg.Logger
	nc, err := nats.Connect(strings.Join(s.cfg.URLs, ","), opts...)
	if err != nil {
		log.Error("cannot connect to NATS; routing on this router's own view", zap.Error(err))
		close(s.done)
		return
	}
	if !nc.IsConnected() {
		log.Warn("NATS unreachable; routing on this router's own view while the client keeps trying",
			zap.Strings("servers", withoutUserInfo(s.cfg.URLs)))
	}
	// Hand the connection over before subscribing, so that no peer's
	// batch is applied after a Close.
	s.mu.Lock()
	select {
	case <-s.stop: // closed while connecting
		s.mu.Unlock()
		nc.Close()
		close(s.done)
		return
	default:
	}
	s.nc = nc
	s.mu.Unlock()
	go s.watchConnErrors(nc)
	sub, err := nc.Subscribe(s.cfg.Subject, s.receive)
	if err != nil {
		log.Error("cannot subscribe to the sync subject; routing on this router's own view", zap.String("subject", s.cfg.Subject), zap.Error(err))
		close(s.done) // Close closes nc
		return
	}
	if s.cfg.PendingBytes > 0 {
		sub.SetPendingLimits(nats.DefaultSubPendingMsgsLimit, s.cfg.PendingBytes)
	}
	// Events from now on are published; the ones before were dropped,
	// as an outage's are: replayed late, they would charge peers with
	// work long released. Under mu, so that a Close meanwhile (which
	// clears live under mu) is not undone.
	s.mu.Lock()
	select {
	case <-s.stop:
	default:
		// A new connection restates what this router has in flight (a
		// reload that changed the sync block made it under the old one).
		s.restate.Store(true)
		s.live.Store(true)
	}
	s.mu.Unlock()
	if nc.IsConnected() {
		s.notePayloadLimit(nc)
		s.markUp()
	}
	go s.snapshots(nc)
	s.run()
}

// SameRouter says s and o publish as one router: the same name on the
// same subject.
func (s *Syncer) SameRouter(o *Syncer) bool {
	return s.cfg.Name == o.cfg.Name && s.cfg.Subject == o.cfg.Subject
}

// Replaces makes s the successor of old, a connection of the same router
// (SameRouter) that a reload replaced and that lives on until the old
// configuration is cleaned up: once s is connected, old publishes nothing
// more. Every message goes to both, so nothing is lost; and old must not
// renew its identity (after a blip of its server), which would make the
// peers take its name for the router's latest and ignore s's batches as
// an earlier name's.
func (s *Syncer) Replaces(old *Syncer) {
	go func() {
		select {
		case <-s.up:
			old.retired.Store(true)
		case <-s.stop:
		case <-old.stop:
		}
	}()
}

// markUp notes that the first connection is made.
func (s *Syncer) markUp() { s.upOnce.Do(func() { close(s.up) }) }

// snapshotSubject is where starting routers ask for a snapshot; one
// router of the queue group of the same name answers each request.
func (s *Syncer) snapshotSubject() string { return s.cfg.Subject + ".snapshot" }

// Waits for a snapshot: its first answer (a peer answers at once, and
// without one the server says so at once), and each next part. A snapshot
// cut short is asked for again, snapshotTries times in all, a second
// apart.
const (
	snapshotFirstWait = 5 * time.Second
	snapshotPartWait  = 10 * time.Second
	snapshotTries     = 3
	snapshotRetryWait = time.Second
)

// snapshotPermissionHint is logged where a snapshot's replies may have
// been refused by the NATS user's permissions.
const snapshotPermissionHint = "a snapshot is several replies: a NATS user whose permissions have " +
	"allow_responses: true may send one; give it allow_responses: { max: -1 } (see caddyfile-examples/nats-server.conf)"

// partHeader numbers a snapshot's parts, from 1, so that a requester
// stops at a part lost (a reconnection in the middle): what follows a
// gap could restore a chain's blocks without their parent.
const partHeader = "Llm-Affinity-Part"

// snapshots, once connected, asks a peer for a snapshot of the view and
// applies it, then joins the routers that answer others' requests: only
// once it has a view to give (a whole snapshot, or no peer to ask), and
// never before asking, so that its own request never reaches itself.
func (s *Syncer) snapshots(nc *nats.Conn) {
	select {
	case <-s.up:
	case <-s.stop:
		return
	}
	if s.cfg.OnSnapshot != nil {
		for try := 1; !s.askSnapshot(nc) && try < snapshotTries; try++ {
			select {
			case <-time.After(snapshotRetryWait):
			case <-s.stop:
				return
			}
		}
	}
	if s.cfg.Snapshot == nil {
		return
	}
	subject := s.snapshotSubject()
	if _, err := nc.QueueSubscribe(subject, subject, s.answerSnapshot); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		s.cfg.Logger.Warn("cannot answer starting routers' requests for a snapshot", zap.String("subject", subject), zap.Error(err))
	}
}

// askSnapshot asks one peer for a snapshot and applies its parts as they
// come, until the empty batch that ends it. It reports false when the
// snapshot was cut short (asking again may do better); whatever came
// before stays applied: it is true, only less.
func (s *Syncer) askSnapshot(nc *nats.Conn) bool {
	log := s.cfg.Logger
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		log.Warn("cannot ask the peers for a snapshot", zap.Error(err))
		return false
	}
	defer sub.Unsubscribe()
	s.liveOpsMu.Lock()
	s.liveOps, s.liveForgot, s.liveForgotten = map[string]bool{}, map[string]map[uint64]struct{}{}, 0
	s.liveOpsMu.Unlock()
	defer func() {
		s.liveOpsMu.Lock()
		s.liveOps, s.liveForgot, s.liveForgotten = nil, nil, 0
		s.liveOpsMu.Unlock()
	}()
	if err := nc.PublishRequest(s.snapshotSubject(), inbox, binary.AppendUvarint(nil, s.cfg.Instance)); err != nil {
		log.Warn("cannot ask the peers for a snapshot", zap.Error(err))
		return false
	}
	wait, from, parts := snapshotFirstWait, "", 0
	for {
		msg, err := sub.NextMsg(wait)
		switch {
		case errors.Is(err, nats.ErrNoResponders):
			// No peer: this router is the first, or the only one on its
			// subject (a typo in one router's subject looks like this).
			log.Info("no peer on the sync subject to take a view from; starting with this router's own",
				zap.String("subject", s.cfg.Subject))
			return true
		case errors.Is(err, nats.ErrTimeout) && from == "":
			log.Info("no peer answered the request for a snapshot; starting with an empty view")
			return true
		case err != nil && parts > 0 && errors.Is(err, nats.ErrTimeout):
			// The peer's further replies were refused, or lost.
			log.Warn("the snapshot was cut short", zap.String("from", from), zap.Int("parts", parts), zap.Error(err),
				zap.String("hint", snapshotPermissionHint))
			return false
		case err != nil:
			log.Warn("the snapshot was cut short", zap.String("from", from), zap.Int("parts", parts), zap.Error(err))
			return false
		}
		if n, _ := strconv.Atoi(msg.Header.Get(partHeader)); n != parts+1 {
			log.Warn("a part of the snapshot was lost; keeping the parts before it", zap.String("from", from), zap.Int("parts", parts))
			return false
		}
		parts++
		b, err := DecodeBatch(msg.Data)
		if err != nil {
			s.malformed.Add(1)
			log.Warn("a part of the snapshot did not decode; keeping the parts before it", zap.Error(err))
			return false
		}
		from = peerName(b.Sender, b.Epoch)
		if b.Instance == s.cfg.Instance {
			// This router's earlier connection, still in the queue group
			// after a reload: the view is the one this router has.
			log.Info("kept this router's own view: its earlier connection answered the request for a snapshot", zap.String("from", from))
			return true
		}
		if len(b.Messages) == 0 {
			s.snapshotFrom.Store(&from)
			log.Info("started with a peer's view", zap.String("from", from), zap.Uint64("messages", s.snapshotMessages.Load()))
			return true
		}
		times := opTimes(msg)
		for _, m := range b.Messages {
			select {
			case <-s.stop:
				return true
			default:
			}
			if m.opDial() != "" && len(times) > 0 {
				// When the peer knows the drain was made: this router's
				// own later op of the upstream is placed after it.
				s.noteOpAt(m.opDial(), times[0])
				times = times[1:]
			}
			if s.newerLiveOp(&m) {
				continue
			}
			s.leaveOutForgotten(&m)
			s.cfg.OnSnapshot(from, m)
			s.snapshotMessages.Add(1)
		}
		wait = snapshotPartWait
	}
}

// noteLiveOp records, while a snapshot is being applied, an operator's
// drain or undrain that arrived live.
func (s *Syncer) noteLiveOp(m *Message) {
	dial := m.opDial()
	if dial == "" {
		return
	}
	s.liveOpsMu.Lock()
	defer s.liveOpsMu.Unlock()
	if s.liveOps != nil {
		s.liveOps[dial] = true
	}
}

// maxLiveForgot bounds the blocks noteLiveForgot holds.
const maxLiveForgot = 1 << 16

// noteLiveForgot records, while a snapshot is being applied, the blocks
// a failed request's router forgot (its EventForgot, heard live or sent
// by this router): the peer that answers may have taken its snapshot
// before it heard of the failure.
func (s *Syncer) noteLiveForgot(m *Message) {
	ev := m.Event
	if ev == nil || ev.Kind != router.EventForgot {
		return
	}
	s.liveOpsMu.Lock()
	defer s.liveOpsMu.Unlock()
	if s.liveForgot == nil {
		return
	}
	blocks := s.liveForgot[ev.Dial]
	if blocks == nil {
		blocks = map[uint64]struct{}{}
		s.liveForgot[ev.Dial] = blocks
	}
	for _, h := range ev.SenderForgot() {
		if s.liveForgotten >= maxLiveForgot {
			return
		}
		if _, ok := blocks[h]; !ok {
			blocks[h] = struct{}{}
			s.liveForgotten++
		}
	}
}

// leaveOutForgotten takes out of a snapshot's cached blocks those a
// failed request made the routers forget since the snapshot was asked
// for (see noteLiveForgot).
func (s *Syncer) leaveOutForgotten(m *Message) {
	ev := m.Event
	if ev == nil || ev.Kind != router.EventCached || len(ev.Hashes) == 0 {
		return
	}
	s.liveOpsMu.Lock()
	defer s.liveOpsMu.Unlock()
	if blocks := s.liveForgot[ev.Dial]; len(blocks) > 0 {
		ev.Hashes = slices.DeleteFunc(ev.Hashes, func(h uint64) bool { _, ok := blocks[h]; return ok })
	}
}

// newerLiveOp reports whether m is a snapshot's drain of an upstream whose
// drain or undrain arrived live since the snapshot was asked for.
func (s *Syncer) newerLiveOp(m *Message) bool {
	if m.Drain == "" {
		return false
	}
	s.liveOpsMu.Lock()
	defer s.liveOpsMu.Unlock()
	return s.liveOps[m.Drain]
}

// answerSnapshot answers a starting router's request with Config.Snapshot,
// in batches within the publication bounds, and an empty batch to end it.
func (s *Syncer) answerSnapshot(msg *nats.Msg) {
	instance, n := binary.Uvarint(msg.Data)
	if msg.Reply == "" || n <= 0 {
		return
	}
	nc := s.conn()
	var msgs []Message
	if instance != s.cfg.Instance {
		msgs = s.cfg.Snapshot()
		s.stampSnapshotOps(msgs)
	}
	// Else a new connection of this router's own (a reload changed its
	// sync options) asks, while this one is still in the queue group: it
	// has this view already, and the end alone tells it so at once.
	b := Batch{Sender: s.cfg.Name, Epoch: s.epoch.Load(), Instance: s.cfg.Instance}
	size, parts, limit := 0, 0, s.batchBytes()
	send := func() error {
		parts++
		reply := nats.NewMsg(msg.Reply)
		reply.Header.Set(partHeader, strconv.Itoa(parts))
		setOpTimes(reply.Header, b.Messages)
		reply.Data = AppendBatch(nil, &b)
		b.Messages, size = b.Messages[:0], 0
		return nc.PublishMsg(reply)
	}
	for i := range msgs {
		n := encodedSize(&msgs[i])
		if batchFull(len(b.Messages), size, n, limit) {
			if err := send(); err != nil {
				s.cfg.Logger.Warn("cannot send a starting router its snapshot", zap.Error(err))
				return
			}
		}
		b.Messages = append(b.Messages, msgs[i])
		size += n
	}
	if len(b.Messages) > 0 {
		if err := send(); err != nil {
			s.cfg.Logger.Warn("cannot send a starting router its snapshot", zap.Error(err))
			return
		}
	}
	if send() == nil && instance != s.cfg.Instance { // the end
		s.snapshotsSent.Add(1)
	}
}

// conn is the connection, nil until connect hands it over.
func (s *Syncer) conn() *nats.Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.nc
}

// Publish queues m for this router's peers. It never blocks: it reports
// false (and counts a drop) when the queue is full. m.Event.Hashes is
// copied at once.
func (s *Syncer) Publish(m Message) bool {
	if s.retired.Load() {
		return true // its successor publishes it
	}
	if m.Event != nil {
		ev := *m.Event
		ev.Hashes = append([]uint64(nil), ev.Hashes[:min(len(ev.Hashes), MaxEventHashes)]...)
		m.Event = &ev
	}
	s.numberOp(&m)
	s.noteOwnOp(m)
	s.noteLiveForgot(&m)
	if !s.live.Load() {
		// Not connected yet (or closed): no peer has heard of a charge
		// yet, but an operator's drain and a stored response's home are
		// sent once connected.
		s.countDropped(&m)
		select {
		case <-s.stop:
		default:
			s.keepOp(m)
			s.keepStored(m)
		}
		return false
	}
	select {
	case s.queue <- m:
		return true
	default:
		s.drop(m)
		return false
	}
}

// drop counts m as dropped and notes what the peers missed: a charge's
// routing or release (its progress carries running totals, which the
// next one makes good), an operator's drain, or a stored response's home
// (kept to send again). Nothing restates index changes (but see unsent).
func (s *Syncer) drop(m Message) {
	s.countDropped(&m)
	if ev := m.Event; ev != nil && ev.Kind != router.EventProgressed && ev.Kind != router.EventStored && !isIndexEvent(ev.Kind) {
		s.lost.Store(true)
	}
	s.keepOp(m)
	s.keepStored(m)
}

// countDropped counts m in events_dropped, once: a message kept to send
// again is not counted again when that fails too.
func (s *Syncer) countDropped(m *Message) {
	if !m.countedDropped {
		m.countedDropped = true
		s.dropped.Add(1)
	}
}

// numberOp numbers m, when it is an operator's drain or undrain, in the
// order they were made, and places it after every op of its upstream
// known here: the operator's latest action stands at every peer, even
// after one a peer with a fast clock (or this router, before its clock
// stepped back) stamped later than now.
func (s *Syncer) numberOp(m *Message) {
	dial := m.opDial()
	if dial == "" {
		return
	}
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	s.opSeq++
	m.seq, m.made = s.opSeq, time.Now()
	// Placed after a later op by a random part of a millisecond: two
	// routers that knew the same one and act within a message's travel
	// would otherwise stamp theirs alike, and each take the other's.
	m.order = m.made.UnixNano()
	if latest := s.opAt[dial]; m.order <= latest {
		m.order = latest + 1 + rand.Int64N(int64(time.Millisecond))
	}
	s.noteOpAtLocked(dial, m.order)
}

// noteOwnOp keeps m, when it is this router's operator's drain or
// undrain, to restate (see ownOps).
func (s *Syncer) noteOwnOp(m Message) {
	dial := m.opDial()
	if dial == "" {
		return
	}
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	if s.ownOps == nil {
		s.ownOps = make(map[string]Message)
	}
	if _, ok := s.ownOps[dial]; ok || len(s.ownOps) < maxLostOps {
		s.ownOps[dial] = m
	}
	s.noteOpAtLocked(dial, m.order)
}

// stampSnapshotOps gives the operators' drains among msgs, a snapshot,
// the time of the latest op of their upstream known here.
func (s *Syncer) stampSnapshotOps(msgs []Message) {
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	for i := range msgs {
		if dial := msgs[i].opDial(); dial != "" {
			msgs[i].order = s.opAt[dial]
		}
	}
}

// noteOpAt is noteOpAtLocked, taking the lock; an unknown time (0) is
// not noted.
func (s *Syncer) noteOpAt(dial string, at int64) {
	if at == 0 {
		return
	}
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	s.noteOpAtLocked(dial, at)
}

// noteOpAtLocked records at as when dial's latest op was made, if later
// than what is known. Caller holds opsMu.
func (s *Syncer) noteOpAtLocked(dial string, at int64) {
	if s.opAt == nil {
		s.opAt = make(map[string]int64)
	}
	if _, known := s.opAt[dial]; !known && len(s.opAt) >= maxLostOps {
		// Bounded: the upstream whose latest op is the oldest goes.
		// Forgetting it lets a stale op of it through, or has this
		// router's next op of it stamped by its clock alone.
		oldest, oldestAt := "", int64(math.MaxInt64)
		for d, t := range s.opAt {
			if t < oldestAt {
				oldest, oldestAt = d, t
			}
		}
		delete(s.opAt, oldest)
	}
	s.opAt[dial] = max(s.opAt[dial], at)
}

// peerOp takes a peer's drain or undrain m, made at (unix nanoseconds; 0
// unknown), and reports whether it stands: not when one of the same
// upstream made later is known here. One that stands replaces this
// router's own op of the upstream.
func (s *Syncer) peerOp(m *Message, at int64) bool {
	dial := m.opDial()
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	if at != 0 && at < s.opAt[dial] {
		return false
	}
	delete(s.ownOps, dial)
	if at != 0 {
		s.noteOpAtLocked(dial, at)
	}
	return true
}

// opDial is the upstream m concerns when it is an operator's drain or
// undrain, "" for a charge's event.
func (m *Message) opDial() string { return cmp.Or(m.Drain, m.Undrain) }

// deadlineLeft is m with, when it is an operator's drain, what is left of
// its deadline, which counts from when the operator made it.
func (m Message) deadlineLeft() Message {
	if m.Drain != "" && !m.made.IsZero() {
		m.Deadline = max(0, m.Deadline-time.Since(m.made))
	}
	return m
}

// ownOpsToRestate returns this router's operators' latest drains and
// undrains, a drain with what is left of its deadline.
func (s *Syncer) ownOpsToRestate() []Message {
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	out := make([]Message, 0, len(s.ownOps))
	for _, m := range s.ownOps {
		out = append(out, m.deadlineLeft())
	}
	return out
}

// supersededOp reports whether m is an operator's message of an upstream
// that a later one, kept to be sent again, concerns: sent after it, m
// would undo it.
func (s *Syncer) supersededOp(m *Message) bool {
	dial := m.opDial()
	if dial == "" {
		return false
	}
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	kept, ok := s.keptSeq[dial]
	return ok && m.seq < kept
}

// keepOp keeps m, when it is an operator's drain or undrain, to send once
// connected: it replaces an earlier one of the same upstream, never a
// later one (a batch that failed to send may hold an older one).
func (s *Syncer) keepOp(m Message) {
	dial := m.opDial()
	if dial == "" {
		return
	}
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	if s.lostOps == nil {
		s.lostOps = make(map[string]Message)
	}
	old, kept := s.lostOps[dial]
	if kept && old.seq > m.seq {
		return
	}
	if kept || len(s.lostOps) < maxLostOps {
		s.lostOps[dial] = m
		if s.keptSeq == nil || len(s.keptSeq) >= maxLostOps {
			s.keptSeq = make(map[string]uint64)
		}
		s.keptSeq[dial] = max(s.keptSeq[dial], m.seq)
	}
}

// unsent drops m, which the publishing loop took in its order but could
// not send; a failed request's forget is kept to send once connected, in
// that order still: everything queued before it went before it. (One a
// full queue drops is not kept: messages queued before it would follow
// it.)
func (s *Syncer) unsent(m Message) {
	s.countDropped(&m) // the copy kept is counted
	s.drop(m)
	if ev := m.Event; ev != nil && ev.Kind == router.EventForgot {
		s.keepForget(m)
	}
}

// maxLostOps bounds the operators' drains kept while disconnected,
// maxLostForgetHashes the hashes of the forgets kept, and maxLostStored
// the stored responses' homes (an id is at most 256 bytes).
const (
	maxLostOps          = 4096
	maxLostForgetHashes = 1 << 18
	maxLostStored       = 1 << 14
)

// keepForget keeps m, a forget that could not be sent, to send once
// connected (see lostForgets); beyond the bound it is lost.
func (s *Syncer) keepForget(m Message) {
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	if n := len(m.Event.Hashes); s.lostForgetHashes+n <= maxLostForgetHashes {
		s.lostForgets = append(s.lostForgets, m)
		s.lostForgetHashes += n
	}
}

// keepStored keeps m, when it is a stored response's home, to send once
// connected; beyond maxLostStored it is lost.
func (s *Syncer) keepStored(m Message) {
	if m.Event == nil || m.Event.Kind != router.EventStored {
		return
	}
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	if len(s.lostStored) < maxLostStored {
		s.lostStored = append(s.lostStored, m)
	}
}

// takeLostStored returns the stored responses' homes that could not be
// sent, and forgets them.
func (s *Syncer) takeLostStored() []Message {
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	out := s.lostStored
	s.lostStored = nil
	return out
}

// takeLostForgets returns the forgets that could not be sent, in order,
// and forgets them.
func (s *Syncer) takeLostForgets() []Message {
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	out := s.lostForgets
	s.lostForgets, s.lostForgetHashes = nil, 0
	return out
}

// takeLostOps returns the operators' drains that could not be sent, and
// forgets them. A drain's deadline counts from when the operator made it,
// as it does on this router: what is left of it goes.
func (s *Syncer) takeLostOps() []Message {
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	out := make([]Message, 0, len(s.lostOps))
	for _, m := range s.lostOps {
		out = append(out, m.deadlineLeft())
	}
	clear(s.lostOps)
	return out
}

// run publishes queued messages until Close, and sends heartbeats while
// idle. A message goes out at once, with whatever queued behind it while
// the last batch was published: no timer delays an event (a peer deciding
// a conversation's next turn must already know where its last one went),
// and under load batches grow by themselves.
func (s *Syncer) run() {
	defer close(s.done)
	// Stored responses travel in batches of their own (see AppendBatch),
	// so that a router of the version before keeps reading the charges;
	// so do forgotten and prefilled blocks (index), unnumbered, in the
	// order of the charges around them: a forget must not overtake the
	// routing that inserted the blocks, nor a later routing that inserted
	// them again overtake it.
	batch := Batch{Sender: s.cfg.Name, Epoch: s.epoch.Load(), Instance: s.cfg.Instance}
	stored, index := batch, batch
	var lastRenewal time.Time
	var buf []byte
	heartbeat := time.NewTicker(s.cfg.HeartbeatInterval)
	defer heartbeat.Stop()
	sentSinceBeat := false
	// progressAt indexes the batch's progress events by charge: a later
	// one replaces an earlier (they carry running totals).
	progressAt := map[uint64]int{}
	size, storedSize, indexSize := 0, 0, 0
	// One message, its header reused: the client encodes it at once.
	msg := &nats.Msg{Subject: s.cfg.Subject, Header: nats.Header{}}
	var seq uint64 // the last batch number sent (see seqHeader)
	var pubErrsLogged loggedReasons
	send := func(b *Batch, numbered bool) {
		if s.retired.Load() {
			b.Messages = b.Messages[:0] // not even a heartbeat: its successor speaks
			return
		}
		n := uint64(len(b.Messages))
		select {
		case <-s.stop:
			// Closing: what is left goes unsent rather than keep Close
			// waiting on the network.
			for i := range b.Messages {
				s.countDropped(&b.Messages[i])
			}
		default:
			if !s.connected.Load() {
				// Disconnected: the client would refuse it anyway, and
				// while it reconnects it holds its lock through each
				// attempt, which the publication would wait for.
				for _, m := range b.Messages {
					s.unsent(m)
				}
				break
			}
			buf = AppendBatch(buf[:0], b)
			msg.Data = buf
			if numbered {
				msg.Header.Set(seqHeader, strconv.FormatUint(seq+1, 10))
			} else {
				// A router of the version before rejects it: a number
				// would make it see a gap, and renew, at every one.
				msg.Header.Del(seqHeader)
			}
			setOpTimes(msg.Header, b.Messages)
			if err := s.nc.PublishMsg(msg); err != nil {
				for _, m := range b.Messages {
					s.unsent(m)
				}
				s.notePublishError(err, &pubErrsLogged)
				if errors.Is(err, os.ErrDeadlineExceeded) {
					// The path to the server stalled without closing:
					// the client would notice only at its next ping,
					// and block every publication until then.
					// Reconnect now.
					s.connected.Store(false)
					s.nc.ForceReconnect()
				}
			} else {
				if numbered {
					seq++
				}
				s.sent.Add(n)
			}
		}
		b.Messages = b.Messages[:0]
		// Every router reads a numbered batch: it says this one is alive.
		sentSinceBeat = sentSinceBeat || numbered
	}
	sendCharges := func() {
		send(&batch, true)
		size = 0
		clear(progressAt)
	}
	sendIndex := func() {
		send(&index, false)
		indexSize = 0
	}
	// publish sends what is batched; with nothing numbered batched, an
	// empty batch (a heartbeat). Of the charges and the index changes,
	// at most one is batched: adding to one sends the other.
	publish := func() {
		beat := true
		if len(stored.Messages) > 0 {
			send(&stored, true)
			storedSize = 0
			beat = false
		}
		if len(index.Messages) > 0 {
			sendIndex()
		}
		if len(batch.Messages) > 0 || beat {
			sendCharges()
		}
	}
	add := func(m Message) {
		if s.supersededOp(&m) {
			return
		}
		n := encodedSize(&m)
		// Read at each message: a reconnection may reach a server with
		// another payload limit at any time.
		limit := s.batchBytes()
		if ev := m.Event; ev != nil && isIndexEvent(ev.Kind) {
			if len(batch.Messages) > 0 {
				sendCharges()
			}
			if batchFull(len(index.Messages), indexSize, n, limit) {
				sendIndex()
			}
			index.Messages = append(index.Messages, m)
			indexSize += n
			return
		}
		if versionOf(&m) > chargeWireVersion {
			if batchFull(len(stored.Messages), storedSize, n, limit) {
				publish()
			}
			stored.Messages = append(stored.Messages, m)
			storedSize += n
			return
		}
		if len(index.Messages) > 0 {
			sendIndex()
		}
		if ev := m.Event; ev != nil && ev.Kind == router.EventProgressed {
			if i, ok := progressAt[ev.ID]; ok {
				batch.Messages[i] = m
				s.sent.Add(1) // merged into the running total
				return
			}
			progressAt[ev.ID] = len(batch.Messages)
		}
		if batchFull(len(batch.Messages), size, n, limit) {
			publish()
		}
		batch.Messages = append(batch.Messages, m)
		size += n
	}
	// renew, once connected after messages were lost, publishes under a
	// new identity; whenever charges are to be restated, it restates them
	// with this router's operators' latest drains and undrains, and sends
	// the ones that were not sent.
	renew := func() {
		if !s.connected.Load() || s.retired.Load() {
			return
		}
		restate := s.restate.Swap(false)
		if s.lost.Load() && time.Since(lastRenewal) >= renewInterval {
			s.lost.Store(false)
			s.missedWarned.Store(false)
			lastRenewal = time.Now()
			epoch := max(uint64(lastRenewal.UnixNano()), s.epoch.Load()+1)
			s.epoch.Store(epoch)
			batch.Epoch, stored.Epoch, index.Epoch = epoch, epoch, epoch
			self := peerName(s.cfg.Name, epoch)
			s.self.Store(&self)
			s.cfg.Logger.Info("messages to the peers were lost: sharing under a new identity, restating what is in flight",
				zap.String("name", self))
			// Peers that missed its batches see only its new name, no
			// gap: what it restates must cover them, its operators'
			// drains too.
			restate = true
			s.restateOps.Store(true)
			if s.cut.Swap(false) && s.cfg.OnRenewed != nil {
				s.cfg.OnRenewed(s.peersHeard())
			}
			s.renewals.Add(1) // after OnRenewed: counted, it is done
		}
		if restate && s.cfg.Resync != nil {
			for _, m := range s.cfg.Resync() {
				add(m)
			}
		}
		if s.restateOps.Swap(false) {
			for _, m := range s.ownOpsToRestate() {
				add(m)
			}
		}
		for _, m := range s.takeLostOps() {
			add(m)
		}
		for _, m := range s.takeLostForgets() {
			add(m)
		}
		for _, m := range s.takeLostStored() {
			add(m)
		}
	}
	for {
		// Stop first: a full queue must not keep Close waiting.
		select {
		case <-s.stop:
			return
		default:
		}
		select {
		case m := <-s.queue:
			renew()
			add(m)
		more:
			for len(batch.Messages)+len(stored.Messages)+len(index.Messages) < maxBatch {
				select {
				case m := <-s.queue:
					add(m)
				default:
					break more
				}
			}
			publish()
		case <-heartbeat.C:
			renew()
			if !sentSinceBeat || len(batch.Messages)+len(stored.Messages)+len(index.Messages) > 0 {
				publish() // what renew restated, or an empty batch: alive
			}
			sentSinceBeat = false
		case <-s.stop:
			return
		}
	}
}

// notePublishError logs why the client refused a publication, once for
// each reason (logged holds those logged).
// Losing the connection is logged by its handler (the client, buffering
// nothing while it reconnects, nats.ReconnectBufSize(-1), refuses a
// publication made before that handler ran with ErrReconnectBufExceeded);
// anything else, such as a server whose max_payload is below one event's
// size, would otherwise show only as events dropped and renewals every
// renewInterval.
func (s *Syncer) notePublishError(err error, logged *loggedReasons) {
	if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, nats.ErrConnectionClosed) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, nats.ErrConnectionDraining) ||
		errors.Is(err, nats.ErrReconnectBufExceeded) {
		return
	}
	if !logged.first(err.Error()) {
		return
	}
	fields := []zap.Field{zap.Error(err)}
	if errors.Is(err, nats.ErrMaxPayload) {
		fields = append(fields, zap.String("hint", fmt.Sprintf("batches are kept within the server's max_payload, but one event may take up to %d KB (a long prompt's block hashes): give the NATS server a max_payload of at least that (its default is 1 MB)", maxEventBytes>>10)))
	}
	s.cfg.Logger.Warn("NATS refused a publication; its events are dropped", fields...)
}

// missedBatches notes that peers' batches were lost on their way here:
// what this router counts of their charges may be wrong (releases lost),
// and an operator's drain may be missing. It renews its identity, which
// drops their charges here and makes every peer restate what it has in
// flight, drains included.
func (s *Syncer) missedBatches(why string) {
	s.missed.Add(1)
	s.lost.Store(true)
	s.cut.Store(true)
	if s.missedWarned.Swap(true) {
		return // the renewal to come makes this one good too
	}
	s.cfg.Logger.Warn("peers' routing events were lost on the way; renewing to have them restated", zap.String("why", why))
}

// setOpTimes sets h's opTimesHeader for the operators' messages among
// msgs, or removes it when there are none.
func setOpTimes(h nats.Header, msgs []Message) {
	var b []byte
	for i := range msgs {
		if msgs[i].opDial() == "" {
			continue
		}
		if len(b) > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, msgs[i].order, 10)
	}
	if b == nil {
		h.Del(opTimesHeader)
		return
	}
	h.Set(opTimesHeader, string(b))
}

// opTimes reads msg's opTimesHeader.
func opTimes(msg *nats.Msg) []int64 {
	if msg.Header == nil {
		return nil
	}
	v := msg.Header.Get(opTimesHeader)
	if v == "" {
		return nil
	}
	var out []int64
	for f := range strings.SplitSeq(v, ",") {
		n, _ := strconv.ParseInt(f, 10, 64)
		out = append(out, n)
	}
	return out
}

// batchSeq is msg's batch number, 0 when it has none.
func batchSeq(msg *nats.Msg) uint64 {
	if msg.Header == nil {
		return 0
	}
	n, _ := strconv.ParseUint(msg.Header.Get(seqHeader), 10, 64)
	return n
}

// receive handles one peer batch.
func (s *Syncer) receive(msg *nats.Msg) {
	select {
	case <-s.stop:
		return // closed: the router may have unloaded the state peers' events apply to
	default:
	}
	b, err := DecodeBatch(msg.Data)
	if err != nil {
		s.malformed.Add(1)
		return
	}
	if b.Instance == s.cfg.Instance {
		return // this router's own, from another of its connections
	}
	if b.Sender == s.cfg.Name && s.warnedSameName.CompareAndSwap(false, true) {
		// Routing still works (the names differ by the time each
		// connection started), but the admin view and the logs cannot
		// tell the two apart.
		s.cfg.Logger.Warn("another router on the sync subject uses this router's name; give each its own (sync name)",
			zap.String("name", s.cfg.Name))
	}
	peer := peerName(b.Sender, b.Epoch)
	now := time.Now()
	latest, gap := s.latestName(b, batchSeq(msg), now)
	if !latest {
		s.stale.Add(1)
		return
	}
	if gap {
		s.missedBatches("a gap in " + peer + "'s batch numbers")
	}
	s.lastReceived.Store(now.UnixNano())
	if s.cfg.OnHeard != nil {
		s.cfg.OnHeard(peer)
	}
	times := opTimes(msg)
	for _, m := range b.Messages {
		if m.opDial() != "" {
			var at int64
			if len(times) > 0 {
				at, times = times[0], times[1:]
			}
			if !s.peerOp(&m, at) {
				s.opsSuperseded.Add(1)
				continue
			}
		}
		s.noteLiveOp(&m)
		s.noteLiveForgot(&m)
		if s.cfg.OnMessage != nil {
			s.cfg.OnMessage(peer, m)
		}
		s.applied.Add(1)
	}
}

// latestName reports whether b comes under its sender's latest name, and
// tells OnSuperseded of the name it replaces; gap says batches of that
// name numbered between its last and this one's seq never came. Senders
// without an Instance (the release before) are taken as they come.
func (s *Syncer) latestName(b *Batch, seq uint64, now time.Time) (current, gap bool) {
	if b.Instance == 0 {
		return true, false
	}
	s.sendersMu.Lock()
	defer s.sendersMu.Unlock()
	if now.Sub(s.sendersSeen) > senderMemory {
		for k, n := range s.senders {
			if now.Sub(n.heard) > senderMemory {
				delete(s.senders, k)
			}
		}
		s.sendersSeen = now
	}
	if s.senders == nil {
		s.senders = make(map[senderKey]senderName)
	}
	key := senderKey{b.Instance, b.Sender}
	latest, known := s.senders[key]
	if known && b.Epoch == latest.epoch {
		gap = seq != 0 && latest.seq != 0 && seq != latest.seq+1
	}
	switch {
	case known && b.Epoch < latest.epoch:
		return false, false
	case known && b.Epoch > latest.epoch:
		if s.cfg.OnSuperseded != nil {
			s.cfg.OnSuperseded(peerName(b.Sender, latest.epoch))
		}
		// It renewed: it lost messages, and drops what it counted of
		// this router's charges.
		s.restate.Store(true)
		s.restateOps.Store(true)
	case !known:
		// A router that starts: it counts this router's charges from
		// the restatement (one it knows ignores it).
		s.restate.Store(true)
	case now.Sub(latest.heard) > s.restateAfterSilence(): // known, the same name
		// One that was cut off, and may have dropped this router's
		// charges as a silent peer's, and missed its operators' drains.
		s.restate.Store(true)
		s.restateOps.Store(true)
	}
	if seq == 0 && known && b.Epoch == latest.epoch {
		seq = latest.seq // an unnumbered batch (see Syncer.run) between numbered ones
	}
	s.senders[key] = senderName{epoch: b.Epoch, heard: now, seq: seq}
	return true, gap
}

// forgetSeqs forgets the batch numbers heard from the peers: the next
// batch of each starts the count again.
func (s *Syncer) forgetSeqs() {
	s.sendersMu.Lock()
	defer s.sendersMu.Unlock()
	for k, n := range s.senders {
		n.seq = 0
		s.senders[k] = n
	}
}

// peersHeard returns the latest names of the peers this connection heard
// within senderMemory.
func (s *Syncer) peersHeard() []string {
	s.sendersMu.Lock()
	defer s.sendersMu.Unlock()
	names := make([]string, 0, len(s.senders))
	for k, n := range s.senders {
		names = append(names, peerName(k.name, n.epoch))
	}
	return names
}

// restateAfterSilence is how long a peer may go unheard before this
// router restates its charges to it when it is heard again: three
// heartbeats, under the 5 s after which routers drop a silent peer's.
func (s *Syncer) restateAfterSilence() time.Duration { return 3 * s.cfg.HeartbeatInterval }

// Close stops publishing and disconnects, without waiting on an
// unreachable server.
func (s *Syncer) Close() {
	s.once.Do(func() {
		s.mu.Lock()
		s.live.Store(false)
		close(s.stop)
		nc := s.nc
		s.mu.Unlock()
		if nc == nil {
			return // never started, failed, or still connecting: connect closes what it opens
		}
		<-s.done
		// Flush what is buffered, briefly and only when connected: a
		// reload or shutdown must not wait on an unreachable NATS.
		if nc.IsConnected() {
			nc.FlushTimeout(closeFlushTimeout)
		}
		nc.Close()
		// The client runs its handlers after Close returns: wait, briefly,
		// so that none of them acts after this connection is closed.
		select {
		case <-s.closed:
		case <-time.After(closeFlushTimeout):
		}
	})
}

// Stats returns the counters.
func (s *Syncer) Stats() Stats {
	st := Stats{
		Name: s.Name(), Subject: s.cfg.Subject, Renewals: s.renewals.Load(), Stale: s.stale.Load(),
		Sent: s.sent.Load(), Applied: s.applied.Load(), Dropped: s.dropped.Load(),
		Malformed: s.malformed.Load(), Disconnects: s.disconnects.Load(), Missed: s.missed.Load(),
		Retired: s.retired.Load(), OpsSuperseded: s.opsSuperseded.Load(),
	}
	st.Connected = s.connected.Load()
	if t := s.lastReceived.Load(); t != 0 {
		st.LastReceived = time.Unix(0, t)
	}
	if from := s.snapshotFrom.Load(); from != nil {
		st.SnapshotFrom = *from
	}
	st.SnapshotMessages, st.SnapshotsSent = s.snapshotMessages.Load(), s.snapshotsSent.Load()
	if !st.Connected {
		s.connErrMu.Lock()
		st.LastError = s.connErr
		s.connErrMu.Unlock()
	}
	return st
}
