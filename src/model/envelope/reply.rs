//! Where the reply to a message goes: nobody (a tell), an asker on this
//! node, or an asker on another node, answered over the pipes.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::buffers::with_scratch;
use crate::model::error::{RemoteError, ShardingError, ShardingResult};
use crate::model::identity::UniqueAddress;

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

impl<R> ReplyTo<R> {
    /// Answers `HandlerInterrupted`: the handler began on the message and
    /// stopped without answering (nobody hears it of a tell).
    pub(crate) fn interrupted(self, type_name: &'static str, entity_id: &str) {
        match self {
            ReplyTo::Local(sender) => {
                let _ = sender.send(Err(ShardingError::HandlerInterrupted {
                    type_name,
                    entity_id: entity_id.to_owned(),
                }));
            }
            ReplyTo::Remote(remote) => remote.fail_remote(RemoteError::HandlerInterrupted),
            ReplyTo::Nobody => {}
        }
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
    pub(super) fn send<R: Serialize>(mut self, result: ShardingResult<R>) {
        let Some(sink) = self.sink.take() else { return };
        let reply = match result {
            Ok(reply) => reply,
            Err(error) => return sink.send_reply(self.target, Err(RemoteError::from(&error))),
        };
        with_scratch(|bytes| match ciborium::into_writer(&reply, &mut *bytes) {
            Ok(()) => sink.send_reply(self.target, Ok(bytes)),
            // The handler ran; its answer is lost (processed: yes).
            Err(error) => sink.send_reply(
                self.target,
                Err(RemoteError::Undecodable {
                    what: "reply".into(),
                    error: format!("BUG: the reply does not serialize: {error}"),
                }),
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
