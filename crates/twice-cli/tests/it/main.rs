//! Tests of the `twice` binary, run as a user runs it.

mod demo;
mod serve;
