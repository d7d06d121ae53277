//! Node-to-node pipes (in progress).
