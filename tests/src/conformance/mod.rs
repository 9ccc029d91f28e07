//! Conformance suites: one per trait, generic over the backend.

pub mod channel;
pub mod transport;
