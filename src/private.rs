//! Items the `protocol!` macro expands to. Not part of the stable API.
//!
//! The `Sealed*` traits are the seal of the protocol family: only code that
//! names this hidden module can implement them, and only `protocol!` should.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::entity::{DeferredHandler, Entity, EntityContext, Handler, ReplyPort};
use crate::error::{ShardingError, ShardingResult};
use crate::identity::UniqueAddress;
use crate::protocol::{Message, Protocol};
use crate::sharding::wire::RemoteError;

/// Seal of [`Protocol`], and its decoder for messages from other nodes.
pub trait SealedProtocol {
    /// Decodes message `index` of this protocol from its CBOR bytes.
    fn decode(
        index: u16,
        bytes: &[u8],
        reply: Option<RemoteReply>,
        hops: u8,
    ) -> Result<LocalEnvelope, Box<Undecodable>>;
}
/// Seal of [`Message`].
pub trait SealedMessage<P> {}
/// Seal of [`Tell`](crate::Tell).
pub trait SealedTell<P> {}
/// Seal of [`Ask`](crate::Ask).
pub trait SealedAsk<P> {}

/// Runs a type-erased envelope against an entity. `protocol!` implements it for
/// the protocol marker, generic over every entity that handles all its messages.
pub trait Dispatch<E: Entity<Protocol = Self>>: Protocol {
    /// Handles one envelope on `entity`.
    fn dispatch(
        entity: &mut E,
        envelope: LocalEnvelope,
        ctx: &EntityContext,
    ) -> impl Future<Output = Outcome> + Send;
}

/// Where the reply to one message goes.
pub(crate) enum ReplyTo<R> {
    /// A tell: nobody waits.
    Nobody,
    /// An asker on this node, waiting on a oneshot.
    Local(oneshot::Sender<ShardingResult<R>>),
    /// An asker on another node: the reply is encoded and sent to its origin.
    Remote(RemoteReply),
}

impl<R: Serialize> ReplyTo<R> {
    /// Hands `result` to whoever waits for it (nobody, for a tell).
    pub(crate) fn answer(self, result: ShardingResult<R>) {
        match self {
            ReplyTo::Local(sender) => {
                let _ = sender.send(result);
            }
            ReplyTo::Remote(remote) => remote.send(result),
            ReplyTo::Nobody => {}
        }
    }
}

/// The typed message and its reply slot, behind one allocation.
struct Typed<M, R> {
    msg: M,
    reply: ReplyTo<R>,
}

/// A message on its way to an entity: the typed value itself, never
/// serialized while it stays on this node, with where its reply goes.
pub struct LocalEnvelope {
    index: u16,
    /// How many nodes forwarded it already (0: sent on this node).
    hops: u8,
    /// For an envelope from another node: the allocation generation under
    /// which the sender routed it here (0 for local sends).
    generation: u64,
    body: Box<dyn Any + Send>,
    fail: fn(Box<dyn Any + Send>, ShardingError),
    into_remote: IntoRemote,
}

/// Encodes an envelope's message and splits off its reply route, or gives the
/// body back with the reason it could not be encoded.
type IntoRemote =
    fn(Box<dyn Any + Send>, &mut Vec<u8>) -> Result<Route, (ShardingError, Box<dyn Any + Send>)>;

impl std::fmt::Debug for LocalEnvelope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEnvelope")
            .field("index", &self.index)
            .field("hops", &self.hops)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl LocalEnvelope {
    pub(crate) fn new<P: Protocol, M: Message<P>>(
        msg: M,
        reply: Option<oneshot::Sender<ShardingResult<M::Reply>>>,
    ) -> Self {
        let reply = match reply {
            Some(sender) => ReplyTo::Local(sender),
            None => ReplyTo::Nobody,
        };
        Self::build::<P, M>(msg, reply, 0)
    }

    fn build<P: Protocol, M: Message<P>>(msg: M, reply: ReplyTo<M::Reply>, hops: u8) -> Self {
        LocalEnvelope {
            index: M::INDEX,
            hops,
            generation: 0,
            body: Box::new(Typed::<M, M::Reply> { msg, reply }),
            fail: fail_typed::<M, M::Reply>,
            into_remote: into_remote_typed::<M, M::Reply>,
        }
    }

    /// The message's index in its protocol.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// How many nodes have forwarded this envelope.
    pub(crate) fn hops(&self) -> u8 {
        self.hops
    }

    /// The generation the sending node routed this envelope under.
    pub(crate) fn routed_under(&self) -> u64 {
        self.generation
    }

    /// Records the generation the sending node routed this envelope under.
    pub(crate) fn set_routed_under(&mut self, generation: u64) {
        self.generation = generation;
    }

    /// Answers the sender (if it asked) with `error`; the message is dropped.
    pub(crate) fn fail(self, error: ShardingError) {
        (self.fail)(self.body, error)
    }

    /// Encodes the message (CBOR) onto `payload` for another node and splits
    /// off where its reply goes. On error (the message does not serialize)
    /// the envelope comes back.
    pub(crate) fn into_remote(
        self,
        payload: &mut Vec<u8>,
    ) -> Result<RemoteParts, (ShardingError, LocalEnvelope)> {
        let LocalEnvelope {
            index,
            hops,
            generation,
            body,
            fail,
            into_remote,
        } = self;
        match into_remote(body, payload) {
            Ok(route) => Ok(RemoteParts { index, hops, route }),
            Err((error, body)) => Err((
                error,
                LocalEnvelope {
                    index,
                    hops,
                    generation,
                    body,
                    fail,
                    into_remote,
                },
            )),
        }
    }
}

/// An envelope taken apart for the wire.
pub(crate) struct RemoteParts {
    pub(crate) index: u16,
    pub(crate) hops: u8,
    pub(crate) route: Route,
}

/// Where the reply to a message sent to another node goes.
pub(crate) enum Route {
    /// A tell.
    Nobody,
    /// The asker is on this node: the reply comes back as bytes for this.
    Local(PendingReply),
    /// The message was forwarded: the reply goes straight to its origin.
    Remote(RemoteReply),
}

/// Hands an encoded reply (or an error) to the asker waiting in the box.
type CompleteFn = fn(Box<dyn Any + Send>, Result<&[u8], ShardingError>);

/// A local asker waiting for a reply that will arrive encoded.
pub(crate) struct PendingReply {
    sender: Box<dyn Any + Send>,
    complete: CompleteFn,
    is_abandoned: fn(&(dyn Any + Send)) -> bool,
}

impl PendingReply {
    /// Decodes the reply (or takes the error) and hands it to the asker.
    pub(crate) fn complete(self, result: Result<&[u8], ShardingError>) {
        (self.complete)(self.sender, result)
    }

    /// Whether the asker stopped waiting (timed out or was dropped).
    pub(crate) fn is_abandoned(&self) -> bool {
        (self.is_abandoned)(self.sender.as_ref())
    }
}

impl std::fmt::Debug for PendingReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingReply").finish_non_exhaustive()
    }
}

fn fail_typed<M: 'static, R: 'static>(body: Box<dyn Any + Send>, error: ShardingError) {
    if let Ok(typed) = body.downcast::<Typed<M, R>>() {
        match typed.reply {
            ReplyTo::Nobody => {}
            ReplyTo::Local(sender) => {
                let _ = sender.send(Err(error));
            }
            ReplyTo::Remote(remote) => remote.fail(&error),
        }
    }
}

fn into_remote_typed<M, R>(
    body: Box<dyn Any + Send>,
    payload: &mut Vec<u8>,
) -> Result<Route, (ShardingError, Box<dyn Any + Send>)>
where
    M: Serialize + Send + 'static,
    R: DeserializeOwned + Send + 'static,
{
    let typed = match body.downcast::<Typed<M, R>>() {
        Ok(typed) => typed,
        Err(body) => {
            let error = ShardingError::Bug("envelope type does not match its index".into());
            return Err((error, body));
        }
    };
    if let Err(error) = ciborium::into_writer(&typed.msg, &mut *payload) {
        let error = ShardingError::Bug(format!("message does not serialize: {error}"));
        return Err((error, typed));
    }
    if matches!(typed.reply, ReplyTo::Local(_)) {
        // The envelope's own allocation waits for the reply: no new one.
        return Ok(Route::Local(PendingReply {
            sender: typed,
            complete: complete_typed::<M, R>,
            is_abandoned: is_abandoned_typed::<M, R>,
        }));
    }
    Ok(match typed.reply {
        ReplyTo::Remote(remote) => Route::Remote(remote),
        ReplyTo::Nobody | ReplyTo::Local(_) => Route::Nobody,
    })
}

/// Completes the asker waiting in a `Typed<M, R>` whose message was sent
/// away: decodes the reply (or takes the error) and hands it over.
fn complete_typed<M: 'static, R: DeserializeOwned + 'static>(
    pending: Box<dyn Any + Send>,
    result: Result<&[u8], ShardingError>,
) {
    let Ok(typed) = pending.downcast::<Typed<M, R>>() else {
        return;
    };
    let ReplyTo::Local(sender) = typed.reply else {
        return;
    };
    let result = result.and_then(|bytes| {
        from_cbor::<R>(bytes).map_err(|error| ShardingError::Undecodable {
            what: "reply".into(),
            error: error.to_string(),
        })
    });
    let _ = sender.send(result);
}

fn is_abandoned_typed<M: 'static, R: 'static>(pending: &(dyn Any + Send)) -> bool {
    match pending.downcast_ref::<Typed<M, R>>() {
        Some(Typed {
            reply: ReplyTo::Local(sender),
            ..
        }) => sender.is_closed(),
        _ => true,
    }
}

/// Where a remote asker waits: its node and its ask id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyTarget {
    /// The node that asked.
    pub origin: UniqueAddress,
    /// The ask's number on that node.
    pub ask_id: u64,
}

/// Sends encoded replies to remote askers (the sharding layer's pipes).
pub(crate) trait ReplySink: Send + Sync + 'static {
    /// Sends one reply: the CBOR-encoded reply value, or why there is none.
    fn send_reply(&self, target: ReplyTarget, result: Result<&[u8], RemoteError>);
}

thread_local! {
    /// A buffer to encode one message or reply into before it is framed, so
    /// the hot path does not allocate for it.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A buffer to build one data message in, sent from there
    /// (`with_frame`).
    static FRAME: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch buffer, emptied (a fresh buffer when
/// `f` is re-entered).
pub(crate) fn with_scratch<T>(f: impl FnOnce(&mut Vec<u8>) -> T) -> T {
    with_buffer(&SCRATCH, f)
}

/// Runs `f` on this thread's frame buffer, cleared: a payload is built
/// there and sent from there (`Transport::send_slice` copies it into the
/// pipe's queue), with no allocation of its own.
pub(crate) fn with_frame<T>(f: impl FnOnce(&mut Vec<u8>) -> T) -> T {
    with_buffer(&FRAME, f)
}

fn with_buffer<T>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<Vec<u8>>>,
    f: impl FnOnce(&mut Vec<u8>) -> T,
) -> T {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            buf.clear();
            let out = f(&mut buf);
            if buf.capacity() > 64 * 1024 {
                *buf = Vec::new();
            }
            out
        }
        Err(_) => f(&mut Vec::new()),
    })
}

/// The reply slot of a message that came from another node. Answered once;
/// dropped unanswered, it tells the asker the entity stopped before replying.
pub struct RemoteReply {
    target: ReplyTarget,
    sink: Option<Arc<dyn ReplySink>>,
}

impl std::fmt::Debug for RemoteReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteReply")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl RemoteReply {
    pub(crate) fn new(target: ReplyTarget, sink: Arc<dyn ReplySink>) -> Self {
        RemoteReply {
            target,
            sink: Some(sink),
        }
    }

    /// Hands the reply over to the next node: this slot will not answer.
    pub(crate) fn forwarded(mut self) -> ReplyTarget {
        self.sink = None;
        self.target
    }

    /// Encodes and sends the handler's result.
    fn send<R: Serialize>(mut self, result: ShardingResult<R>) {
        let Some(sink) = self.sink.take() else { return };
        let reply = match result {
            Ok(reply) => reply,
            Err(error) => return sink.send_reply(self.target, Err(RemoteError::from(&error))),
        };
        with_scratch(|bytes| match ciborium::into_writer(&reply, &mut *bytes) {
            Ok(()) => sink.send_reply(self.target, Ok(bytes)),
            Err(error) => sink.send_reply(
                self.target,
                Err(RemoteError::Other(format!(
                    "BUG: reply does not serialize: {error}"
                ))),
            ),
        });
    }

    /// Answers with `error`.
    pub(crate) fn fail(self, error: &ShardingError) {
        self.fail_remote(RemoteError::from(error));
    }

    /// Answers with an error in its wire form.
    pub(crate) fn fail_remote(mut self, error: RemoteError) {
        if let Some(sink) = self.sink.take() {
            sink.send_reply(self.target, Err(error));
        }
    }
}

impl Drop for RemoteReply {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            sink.send_reply(self.target, Err(RemoteError::EntityStopped));
        }
    }
}

/// Why a message that arrived from another node could not become an envelope.
#[derive(Debug)]
pub struct Undecodable {
    /// What went wrong, for the sender.
    pub(crate) error: ShardingError,
    /// The reply slot, to answer with the error.
    pub(crate) reply: Option<RemoteReply>,
}

impl Undecodable {
    /// The index names no message of the protocol.
    pub fn unknown_index(index: u16, reply: Option<RemoteReply>) -> Box<Self> {
        Box::new(Undecodable {
            error: ShardingError::Undecodable {
                what: "message".into(),
                error: format!("index {index} names no message of the protocol"),
            },
            reply,
        })
    }
}

/// Decodes message `M` of `P` from its CBOR bytes into an envelope whose
/// reply (if any) goes back to the remote asker.
pub fn decode_as<P: Protocol, M: Message<P>>(
    bytes: &[u8],
    reply: Option<RemoteReply>,
    hops: u8,
) -> Result<LocalEnvelope, Box<Undecodable>> {
    match from_cbor::<M>(bytes) {
        Ok(msg) => {
            let reply = match reply {
                Some(remote) => ReplyTo::Remote(remote),
                None => ReplyTo::Nobody,
            };
            Ok(LocalEnvelope::build::<P, M>(msg, reply, hops))
        }
        Err(error) => Err(Box::new(Undecodable {
            error: ShardingError::Undecodable {
                what: format!("message {} of `{}`", M::INDEX, P::TYPE_NAME),
                error: error.to_string(),
            },
            reply,
        })),
    }
}

thread_local! {
    /// ciborium's decode scratch (4 KiB, as `from_reader` uses), zeroed once
    /// per thread instead of on every call.
    static CBOR_SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; 4096]);
}

/// Decodes one CBOR value exactly as `ciborium::from_reader` does, without
/// zeroing its 4 KiB scratch buffer on every call (which costs more than
/// decoding a small message).
pub(crate) fn from_cbor<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, ciborium::de::Error<std::io::Error>> {
    CBOR_SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => ciborium::de::from_reader_with_buffer(bytes, &mut scratch[..]),
        // Re-entered (a `Deserialize` impl that decodes CBOR itself).
        Err(_) => ciborium::from_reader(bytes),
    })
}

/// FNV-1a 64 over `parts`, each followed by the byte 0xff (which no UTF-8
/// text contains, so the parts cannot run into each other): a protocol's
/// fingerprint.
pub const fn fingerprint(parts: &[&str]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET_BASIS;
    let mut p = 0;
    while p < parts.len() {
        let bytes = parts[p].as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            hash = (hash ^ bytes[i] as u64).wrapping_mul(PRIME);
            i += 1;
        }
        hash = (hash ^ 0xff).wrapping_mul(PRIME);
        p += 1;
    }
    hash
}

/// Whether `name` is a usable protocol wire name: 1 to 64 bytes of ASCII
/// letters, digits, `.`, `_` and `-`.
pub const fn valid_wire_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() > 64 {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if !(b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-') {
            return false;
        }
        i += 1;
    }
    true
}

/// What handling one envelope did to the entity.
#[derive(Debug)]
pub struct Outcome(pub(crate) OutcomeKind);

#[derive(Debug)]
pub(crate) enum OutcomeKind {
    /// The handler ran to completion (with `Ok` or `Err`).
    Handled,
    /// The handler panicked; the entity must be rebuilt.
    Panicked(String),
    /// The envelope did not belong to this protocol (a bug).
    Unknown,
}

impl Outcome {
    /// The envelope's index is not in the protocol: fail it as a bug.
    pub fn unknown(envelope: LocalEnvelope) -> Self {
        let index = envelope.index;
        envelope.fail(ShardingError::Bug(format!(
            "message index {index} is not in the protocol"
        )));
        Outcome(OutcomeKind::Unknown)
    }
}

/// The line style of a `tell`/`ask` message: the handler's return value is
/// the reply.
pub enum Direct {}
/// The line style of a `defer` message: the handler gets a [`ReplyPort`].
pub enum Deferred {}

/// How entity `Self` handles message `M` of style `S` (`Direct` or
/// `Deferred`): what `protocol!`'s dispatch requires of an entity for each
/// line, implemented for every entity with the matching handler.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not handle `{M}` as its protocol declares",
    label = "missing a handler",
    note = "an entity implements `Handler<{M}>` for a `tell` or `ask` line, `DeferredHandler<{M}>` for a `defer` line"
)]
pub trait Handles<M, S>: Entity
where
    M: Message<Self::Protocol>,
{
    /// Runs the handler on one envelope known to carry `M`.
    fn run(
        &mut self,
        envelope: LocalEnvelope,
        ctx: &EntityContext,
    ) -> impl Future<Output = Outcome> + Send;
}

impl<E, M> Handles<M, Direct> for E
where
    E: Handler<M>,
    M: Message<E::Protocol>,
{
    fn run(
        &mut self,
        envelope: LocalEnvelope,
        ctx: &EntityContext,
    ) -> impl Future<Output = Outcome> + Send {
        handle_local::<E::Protocol, E, M>(self, envelope, ctx)
    }
}

impl<E, M> Handles<M, Deferred> for E
where
    E: DeferredHandler<M>,
    M: Message<E::Protocol>,
{
    fn run(
        &mut self,
        envelope: LocalEnvelope,
        ctx: &EntityContext,
    ) -> impl Future<Output = Outcome> + Send {
        handle_deferred::<E::Protocol, E, M>(self, envelope, ctx)
    }
}

/// The typed message inside an envelope known to carry `M`; a mismatch (a
/// bug) is answered and reported as such.
fn open<M: 'static, R: 'static>(envelope: LocalEnvelope) -> Result<Typed<M, R>, Outcome> {
    match envelope.body.downcast::<Typed<M, R>>() {
        Ok(typed) => Ok(*typed),
        Err(body) => {
            (envelope.fail)(
                body,
                ShardingError::Bug("envelope type does not match its index".into()),
            );
            Err(Outcome(OutcomeKind::Unknown))
        }
    }
}

/// Handles one envelope of a `defer` line: the reply slot becomes the
/// handler's `ReplyPort`.
async fn handle_deferred<P, E, M>(
    entity: &mut E,
    envelope: LocalEnvelope,
    ctx: &EntityContext,
) -> Outcome
where
    P: Protocol,
    E: Entity<Protocol = P> + DeferredHandler<M>,
    M: Message<P>,
{
    let Typed { msg, reply } = match open::<M, M::Reply>(envelope) {
        Ok(typed) => typed,
        Err(outcome) => return outcome,
    };
    let port = ReplyPort::new(reply);
    match AssertUnwindSafe(async move { entity.handle(msg, port, ctx).await })
        .catch_unwind()
        .await
    {
        Ok(Ok(())) => Outcome(OutcomeKind::Handled),
        Ok(Err(error)) => {
            tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %error, "deferred handler failed");
            Outcome(OutcomeKind::Handled)
        }
        // The port went down with the handler: its asker hears the entity stopped.
        Err(payload) => Outcome(OutcomeKind::Panicked(panic_message(payload.as_ref()))),
    }
}

/// Handles one envelope known to carry `M`: runs the handler, catches a panic,
/// and answers the asker.
pub async fn handle_local<P, E, M>(
    entity: &mut E,
    envelope: LocalEnvelope,
    ctx: &EntityContext,
) -> Outcome
where
    P: Protocol,
    E: Entity<Protocol = P> + Handler<M>,
    M: Message<P>,
{
    let Typed { msg, reply } = match open::<M, M::Reply>(envelope) {
        Ok(typed) => typed,
        Err(outcome) => return outcome,
    };
    // The whole call sits inside the guarded future, so a panic before
    // `handle` returns its future is caught too.
    match AssertUnwindSafe(async move { entity.handle(msg, ctx).await })
        .catch_unwind()
        .await
    {
        Ok(result) => {
            if let (ReplyTo::Nobody, Err(error)) = (&reply, &result) {
                tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %error, "tell handler failed");
            }
            reply.answer(result);
            Outcome(OutcomeKind::Handled)
        }
        Err(payload) => {
            let panic = panic_message(payload.as_ref());
            let error = ShardingError::EntityPanicked {
                type_name: ctx.type_name(),
                entity_id: ctx.entity_id().to_owned(),
                panic: panic.clone(),
            };
            reply.answer(Err(error));
            Outcome(OutcomeKind::Panicked(panic))
        }
    }
}

pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// The remote-envelope path, exposed for `benches/envelope.rs` only.
pub mod bench {
    use crate::identity::{NodeId, UniqueAddress};
    use crate::private::ReplyTarget;
    use crate::sharding::fast::{self, DataRef, EnvelopeRef};
    use crate::sharding::wire::{DataMsg, DataMsgOut};

    fn target() -> ReplyTarget {
        ReplyTarget {
            origin: UniqueAddress {
                addr: std::net::SocketAddr::from(([127, 0, 0, 1], 7355)),
                node_id: NodeId(0x1234_5678_9abc_def0),
                incarnation: 1_796_000_000_000_000,
            },
            ask_id: 1_000_000,
        }
    }

    fn envelope<'a>(entity_id: &'a str, payload: &'a [u8]) -> EnvelopeRef<'a> {
        EnvelopeRef {
            type_name: "pinger",
            fingerprint: 0x0123_4567_89ab_cdef,
            shard: 42,
            generation: 3,
            entity_id,
            index: 0,
            hops: 0,
            reply_to: Some(target()),
            payload,
        }
    }

    /// Encodes one data-channel envelope through serde.
    pub fn encode_envelope_serde(entity_id: &str, payload: &[u8]) -> Vec<u8> {
        DataMsgOut::Envelope(envelope(entity_id, payload)).encode()
    }

    /// Encodes the same envelope as `Remote::forward` does (by hand).
    pub fn encode_envelope_fast(entity_id: &str, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        fast::encode_envelope(&mut out, &envelope(entity_id, payload));
        out
    }

    /// Decodes a data-channel message through serde; the payload length of
    /// an envelope (0 for anything else).
    pub fn decode_envelope_serde(bytes: &[u8]) -> usize {
        match ciborium::from_reader::<DataMsg, _>(bytes) {
            Ok(DataMsg::Envelope(envelope)) => envelope.payload.len(),
            _ => 0,
        }
    }

    /// A write-behind queue over an in-memory store, for timing what
    /// recording one id costs the region (the push only).
    pub struct RememberQueue(std::sync::Arc<crate::store::writer::Remember>);

    impl RememberQueue {
        /// A queue of `capacity` records in front of an in-memory store.
        pub fn new(capacity: usize) -> Self {
            let config = crate::RememberEntitiesConfig::default().with_queue_capacity(capacity);
            RememberQueue(
                crate::store::writer::Remember::start(
                    std::sync::Arc::new(crate::InMemoryStore::new()),
                    &config,
                )
                .expect("writer thread"),
            )
        }

        /// Queues one start record, as a region does when it spawns an entity.
        pub fn push(&self, entity_id: &std::sync::Arc<str>) {
            self.0.record(
                "bench",
                crate::ShardId(1),
                entity_id,
                crate::RememberEntitiesOperation::RecordStarted,
            );
        }
    }

    /// Decodes it as the inbound path does (by hand, in place).
    pub fn decode_envelope_fast(bytes: &[u8]) -> usize {
        match fast::decode(bytes) {
            Some(DataRef::Envelope(envelope)) => envelope.payload.len(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{fingerprint, valid_wire_name};
    use crate::protocol::Protocol;
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize)]
    pub struct Push(pub u64);
    #[derive(Serialize, Deserialize)]
    pub struct Home;

    crate::protocol! {
        /// SPEC §13's example protocol.
        pub protocol Tally = "tally" {
            tell Push;
            ask Home -> String;
        }
    }

    mod msgs {
        use serde::{Deserialize, Serialize};
        #[derive(Serialize, Deserialize)]
        pub struct Get;
    }

    crate::protocol! {
        pub protocol Paths = "paths" {
            ask msgs::Get -> Vec<u64>;
        }
    }

    #[test]
    fn spec_fingerprint_test_vector() {
        // SPEC §13.6: FNV-1a 64 over "tally" ff "tell Push" ff "ask Home -> String" ff.
        assert_eq!(fingerprint(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(
            fingerprint(&["tally", "tell Push", "ask Home -> String"]),
            0x10f4_3ecc_488b_4809
        );
        assert_eq!(<Tally as Protocol>::FINGERPRINT, 0x10f4_3ecc_488b_4809);
    }

    #[test]
    fn fingerprint_lines_are_stringified_as_rustc_prints_them() {
        // The message path is stringified token by token (rustc 1.95 puts
        // spaces around `::`); the reply, a `ty` fragment, is printed as a
        // type (no spaces around `<>`). SPEC §13.6 pins both.
        assert_eq!(<Paths as Protocol>::MESSAGES[0].name, "msgs :: Get");
        assert_eq!(
            <Paths as Protocol>::FINGERPRINT,
            fingerprint(&["paths", "ask msgs :: Get -> Vec<u64>"])
        );
    }

    #[test]
    fn spec_payload_forms() {
        // SPEC §13.4: a unit struct message is CBOR null, a newtype struct its value.
        let mut bytes = Vec::new();
        ciborium::into_writer(&Home, &mut bytes).expect("encodes");
        assert_eq!(bytes, [0xf6]);
        let mut bytes = Vec::new();
        ciborium::into_writer(&Push(7), &mut bytes).expect("encodes");
        assert_eq!(bytes, [0x07]);
    }

    #[test]
    fn wire_names() {
        assert!(valid_wire_name("tally"));
        assert!(valid_wire_name("A.z_0-9"));
        assert!(valid_wire_name(&"x".repeat(64)));
        assert!(!valid_wire_name(&"x".repeat(65)));
        assert!(!valid_wire_name(""));
        assert!(!valid_wire_name("has space"));
        assert!(!valid_wire_name("café"));
        assert!(!valid_wire_name("a/b"));
    }
}
