//! The Service Bus vocabulary round trip is in [`servicebus`].
//!
//! Decoding costs memory linear in its input: decode bombs (zero-width array elements, described
//! arrays whose descriptor is itself a bomb, nested) and random frames decode within a fixed
//! number of bytes per input byte, measured by the allocator.
//!
//! The allocator of this test binary counts every byte allocated, and each measured decode runs
//! under a limit of [`BYTES_PER_INPUT_BYTE`] times its input size (plus [`BASE_BYTES`]): an
//! allocation past it fails, which aborts the test binary.

#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on setup errors
#![allow(unreachable_pub, missing_docs)] // reason: test modules are not a public API

mod servicebus;

use std::alloc::System;
use std::sync::Mutex;

use cap::Cap;
use proptest::prelude::*;
use twice_amqp::codec::{DecodeError, Decoder};
use twice_amqp::performative::Performative;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// The most bytes a decode may hold at once per byte of its input.
const BYTES_PER_INPUT_BYTE: usize = 1024;
/// The bytes any decode may hold whatever its input's size.
const BASE_BYTES: usize = 64 * 1024;

/// Measured decodes run one at a time, so the allocator's count is theirs.
static MEASURING: Mutex<()> = Mutex::new(());

/// Held by every test of this binary for its whole run: the allocator's limit is global, so
/// while one test measures, no other may allocate (not even proptest drawing its next case).
static ALONE: Mutex<()> = Mutex::new(());

/// Waits until no other test of this binary runs.
pub fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs `f` over `input` with allocation limited to what the input's size allows.
fn within_linear_memory<T>(input: &[u8], f: impl FnOnce(&[u8]) -> T) -> T {
    let _turn = MEASURING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let allowed = input.len() * BYTES_PER_INPUT_BYTE + BASE_BYTES;
    ALLOCATOR.set_limit(ALLOCATOR.allocated() + allowed).unwrap();
    let out = f(input);
    ALLOCATOR.set_limit(usize::MAX).unwrap();
    out
}

/// Decodes every value in `input`, then the input as a frame body; returns the first error.
fn decode_everything(input: &[u8]) -> Option<DecodeError> {
    let _ = Performative::decode(input);
    let mut d = Decoder::new(input);
    while !d.is_empty() {
        if let Err(e) = d.value() {
            return Some(e);
        }
    }
    None
}

/// An array32 of 4096 nulls: ten bytes, 4096 values.
fn zero_width_array() -> Vec<u8> {
    let mut b = vec![0xf0];
    b.extend_from_slice(&5u32.to_be_bytes());
    b.extend_from_slice(&4096u32.to_be_bytes());
    b.push(0x40);
    b
}

/// An array32 of 4096 nulls described by `descriptor`: each element would carry a copy of it.
fn described_array(descriptor: &[u8]) -> Vec<u8> {
    let mut b = vec![0xf0];
    let size = u32::try_from(4 + 1 + descriptor.len() + 1).unwrap();
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&4096u32.to_be_bytes());
    b.push(0x00);
    b.extend_from_slice(descriptor);
    b.push(0x40);
    b
}

/// A `sasl-init` frame body whose initial response is `value`.
fn sasl_init_with(value: &[u8]) -> Vec<u8> {
    let mut fields = vec![0xa3, 5];
    fields.extend_from_slice(b"PLAIN");
    fields.extend_from_slice(value);
    let mut b = vec![0x00, 0x53, 0x41, 0xd0];
    b.extend_from_slice(&u32::try_from(4 + fields.len()).unwrap().to_be_bytes());
    b.extend_from_slice(&2u32.to_be_bytes());
    b.extend_from_slice(&fields);
    b
}

#[test]
fn decode_bombs_are_refused_within_linear_memory() {
    let _alone = alone();
    let one = described_array(&zero_width_array());
    let nested = described_array(&one);
    let bombs = [
        ("4096 nulls", zero_width_array()),
        ("described by 4096 nulls", one.clone()),
        ("nested", nested.clone()),
        ("in a sasl-init", sasl_init_with(&nested)),
    ];
    for (name, bomb) in bombs {
        let error = within_linear_memory(&bomb, decode_everything);
        assert!(
            matches!(error, Some(DecodeError::OverBudget | DecodeError::CountTooLarge)),
            "{name} ({} bytes): {error:?}",
            bomb.len()
        );
    }
    // A frame of this size may arrive before anything is authenticated.
    assert!(sasl_init_with(&nested).len() + 8 < 64);
}

#[test]
fn ordinary_arrays_still_decode() {
    let _alone = alone();
    // A described array of one-byte elements: the densest legitimate encoding.
    let mut b = vec![0xe0, 0, 100, 0x00, 0x53, 0x70, 0x50];
    b.extend(std::iter::repeat_n(7u8, 100));
    b[1] = u8::try_from(b.len() - 2).unwrap();
    let v = within_linear_memory(&b, |b| Decoder::new(b).value()).unwrap();
    let twice_amqp::codec::Value::Array(a) = v else { panic!("an array") };
    assert_eq!(a.items.len(), 100);
}

/// Bytes drawn mostly from the constructors that build the most per byte.
fn structured_bytes() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        4 => prop::sample::select(vec![
            0x00u8, 0x40, 0x41, 0x43, 0x44, 0x45, 0x53, 0x50, 0xa1, 0xa3, 0xc0, 0xc1, 0xd0,
            0xe0, 0xf0, 0x10, 0xff, 0x01, 0x02, 0x04,
        ]),
        1 => any::<u8>(),
    ];
    prop::collection::vec(byte, 0..512)
}

#[test]
fn random_frames_decode_within_linear_memory() {
    // The runner in the test's own hands, so that the whole run, the drawing of each case
    // included, holds the binary alone.
    let _alone = alone();
    let config =
        ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    runner
        .run(&structured_bytes(), |bytes| {
            within_linear_memory(&bytes, decode_everything);
            Ok(())
        })
        .unwrap();
}
