//! Test support shared by twice's crates: server harnesses and fixtures.
