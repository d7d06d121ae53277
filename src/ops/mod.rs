//! Operating a node: the metrics it records (`telemetry`), the events it
//! keeps (`history`), and the HTTP management endpoint that serves them
//! with its probes and state (`management`, feature `management`).

pub mod history;
#[cfg(feature = "management")]
pub mod management;
pub mod telemetry;
