//! Engine tests: data-driven scenarios (`check(script, expect)`, see [`harness`]) and the
//! seeded model test.

mod harness;
mod model;
mod scenarios;
mod seqmap;
