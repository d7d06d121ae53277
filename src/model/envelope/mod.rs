//! What travels to an entity: the envelope (the typed message, never
//! serialized while it stays on this node), where its reply goes, and how
//! both are taken apart for the wire and rebuilt from it.
//!
//! Below the runtime and the sharding layer, which both carry envelopes;
//! above only the error type and node identities. The protocol layer
//! builds envelopes from typed messages (`dispatch::envelope_of`,
//! `dispatch::decode_as`), the runtime delivers them, the sharding layer
//! encodes them for another node ([`LocalEnvelope::into_remote`]).

mod buffers;
mod reply;

use std::any::Any;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;

use crate::model::error::{ShardingError, ShardingResult};

pub(crate) use buffers::{from_cbor, from_ciborium, with_frame, with_scratch};
pub(crate) use reply::ReplySink;
pub(crate) use reply::ReplyTo;
pub use reply::{RemoteReply, ReplyTarget};

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
    /// An ask whose asker waits with no timer of its own if the envelope
    /// goes to another node in the asker's own delivery: the pending-ask
    /// table then keeps its deadline (SPEC §13.5).
    guarded: bool,
    /// For an envelope from another node: the allocation generation under
    /// which the sender routed it here (0 for local sends).
    generation: u64,
    body: Box<dyn Any + Send>,
    /// What the body's type can do once it is erased (one pointer for both).
    fns: &'static BodyFns,
    /// What few envelopes carry, behind one pointer: the trace span and a
    /// reliable producer's tag.
    extras: Option<Box<Extras>>,
}

/// The parts of an envelope that few envelopes have.
#[derive(Default)]
pub(crate) struct Extras {
    /// With tracing on (SPEC §14.2): the span the message was sent in, or
    /// on a receiving node the span whose parent is the sender's; the
    /// handler's span is its child.
    pub(crate) trace: Option<tracing::Span>,
    /// Sent by a reliable producer (SPEC §13.17): who sent it, and its
    /// number in that producer's stream to this entity.
    pub(crate) delivery: Option<Delivery>,
    /// Of an ask made on this node to a durable type: its deadline, which
    /// bounds the store calls its handling makes (SPEC §8b). Kept here,
    /// not in every envelope, so the messages of other types stay small.
    pub(crate) deadline: Option<tokio::time::Instant>,
}

/// A reliable producer's tag on a message (SPEC §13.17): the producer,
/// its incarnation, and the message's number in its stream to one entity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Delivery {
    /// The producer's id, chosen by its user.
    pub(crate) producer: Arc<str>,
    /// The producer's incarnation: a later one supersedes an earlier one.
    pub(crate) epoch: u64,
    /// The message's number, from 1, in the stream to this entity.
    pub(crate) seq: u64,
}

/// The functions of one message type's erased body.
struct BodyFns {
    fail: fn(Box<dyn Any + Send>, ShardingError),
    into_remote: IntoRemote,
}

/// [`BodyFns`] of `Typed<M, R>`, as a constant (so that a reference to it
/// is `'static`).
trait HasBodyFns {
    const FNS: BodyFns;
}

impl<M, R> HasBodyFns for Typed<M, R>
where
    M: Serialize + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    const FNS: BodyFns = BodyFns {
        fail: fail_typed::<M, R>,
        into_remote: into_remote_typed::<M, R>,
    };
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
    /// An envelope for message `msg` (number `index` of its protocol) sent
    /// on this node; `reply` is the asker's, `None` for a tell.
    pub(crate) fn local<M, R>(
        index: u16,
        msg: M,
        reply: Option<oneshot::Sender<ShardingResult<R>>>,
    ) -> Self
    where
        M: Serialize + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        let reply = match reply {
            Some(sender) => ReplyTo::Local(sender),
            None => ReplyTo::Nobody,
        };
        Self::build(index, msg, reply, 0)
    }

    /// An envelope for `msg` whose reply goes to `reply`, forwarded `hops`
    /// times already.
    pub(crate) fn build<M, R>(index: u16, msg: M, reply: ReplyTo<R>, hops: u8) -> Self
    where
        M: Serialize + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        LocalEnvelope {
            index,
            hops,
            guarded: false,
            generation: 0,
            body: Box::new(Typed::<M, R> { msg, reply }),
            fns: &<Typed<M, R> as HasBodyFns>::FNS,
            extras: None,
        }
    }

    /// Gives the envelope its trace span and reliable producer's tag at
    /// once (`None`: neither).
    pub(crate) fn set_extras(&mut self, extras: Option<Box<Extras>>) {
        self.extras = extras;
    }

    /// Tags the envelope as a reliable producer's message.
    pub(crate) fn set_delivery(&mut self, delivery: Delivery) {
        self.extras.get_or_insert_default().delivery = Some(delivery);
    }

    /// The reliable producer's tag, taken out.
    pub(crate) fn take_delivery(&mut self) -> Option<Delivery> {
        self.extras.as_mut()?.delivery.take()
    }

    /// Marks the envelope as an ask whose deadline the pending-ask table
    /// may keep, should it be forwarded in its asker's own delivery.
    pub(crate) fn set_guarded(&mut self) {
        self.guarded = true;
    }

    /// Whether [`set_guarded`](Self::set_guarded) was called.
    pub(crate) fn is_guarded(&self) -> bool {
        self.guarded
    }

    /// Records the deadline of the ask this envelope carries (asks to a
    /// durable type only: it costs an allocation).
    pub(crate) fn set_deadline(&mut self, deadline: tokio::time::Instant) {
        self.extras.get_or_insert_default().deadline = Some(deadline);
    }

    /// The deadline of the ask this envelope carries, if known here: `None`
    /// for a tell, an ask from another node (the wire does not carry it),
    /// and an ask to a type that keeps nothing in a store.
    pub(crate) fn deadline(&self) -> Option<tokio::time::Instant> {
        self.extras.as_ref().and_then(|e| e.deadline)
    }

    /// The span this message is traced under (tracing on).
    pub(crate) fn set_trace(&mut self, span: tracing::Span) {
        self.extras.get_or_insert_default().trace = Some(span);
    }

    /// The span this message is traced under, taken out.
    pub(crate) fn take_trace(&mut self) -> Option<tracing::Span> {
        self.extras.as_mut()?.trace.take()
    }

    /// The typed message and its reply slot, for the handler of `M`. A
    /// mismatch (a bug) answers the sender and gives `None`.
    pub(crate) fn open<M: 'static, R: 'static>(self) -> Option<(M, ReplyTo<R>)> {
        match self.body.downcast::<Typed<M, R>>() {
            Ok(typed) => Some((typed.msg, typed.reply)),
            Err(body) => {
                (self.fns.fail)(
                    body,
                    ShardingError::Bug("envelope type does not match its index".into()),
                );
                None
            }
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
        (self.fns.fail)(self.body, error)
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
            guarded,
            generation,
            body,
            fns,
            extras,
        } = self;
        match (fns.into_remote)(body, payload) {
            Ok(route) => Ok(RemoteParts {
                index,
                hops,
                route,
                extras,
            }),
            Err((error, body)) => Err((
                error,
                LocalEnvelope {
                    index,
                    hops,
                    guarded,
                    generation,
                    body,
                    fns,
                    extras,
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
    /// Its trace span and reliable producer's tag, if it has either.
    pub(crate) extras: Option<Box<Extras>>,
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
