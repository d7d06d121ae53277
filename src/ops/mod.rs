//! Operating a node: the metrics it records (`telemetry`) and the HTTP
//! management endpoint that serves them with its probes and state
//! (`management`, feature `management`).

#[cfg(feature = "management")]
pub mod management;
pub mod telemetry;
