//! The poolipc ownership contract as a sans-IO state machine.
#![forbid(unsafe_code)]
