//! Conformance suites: one per trait, generic over the backend.

pub mod transport;
