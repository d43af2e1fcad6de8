//! What a client that holds one lock token can and cannot do with it: guess the next tokens,
//! or settle a message of another entity.

use twice::{DeadLetterReason, LockToken, Message, Properties};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Error};

use crate::support::NOW;

/// SplitMix64's increment and output function, the generator that would make tokens
/// predictable.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const M1: u64 = 0xBF58_476D_1CE4_E5B9;
const M2: u64 = 0x94D0_49BB_1331_11EB;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(M1);
    z = (z ^ (z >> 27)).wrapping_mul(M2);
    z ^ (z >> 31)
}

/// The inverse of an odd number modulo 2^64 (Newton's iteration doubles the good bits).
fn inverse(c: u64) -> u64 {
    let mut x = c;
    for _ in 0..6 {
        x = x.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(x)));
    }
    x
}

fn unmix(mut z: u64) -> u64 {
    z ^= (z >> 31) ^ (z >> 62);
    z = z.wrapping_mul(inverse(M2));
    z ^= (z >> 27) ^ (z >> 54);
    z = z.wrapping_mul(inverse(M1));
    z ^ (z >> 30) ^ (z >> 60)
}

/// The token made of two generator outputs, as a version-4 UUID.
fn token_of(a: u64, b: u64) -> LockToken {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&a.to_le_bytes());
    bytes[8..].copy_from_slice(&b.to_le_bytes());
    LockToken::from_uuid(uuid::Builder::from_random_bytes(bytes).into_uuid())
}

/// The tokens that would follow `token` if it came from SplitMix64: the generator's state is
/// recovered from the token's first half (4 bits lost to the UUID version, tried in turn) and
/// checked against its second half.
fn predicted_after(token: LockToken, n: u64) -> Vec<LockToken> {
    let bytes = token.as_uuid().as_bytes();
    let a = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let b = u64::from_le_bytes(bytes[8..].try_into().unwrap());
    let mut out = Vec::new();
    for nibble in 0..16u64 {
        let a = (a & !(0xf << 52)) | (nibble << 52);
        let state = unmix(a);
        let second = mix(state.wrapping_add(GAMMA));
        // The UUID variant took the top two bits of the second half's first byte.
        if second & !0xc0 != b & !0xc0 {
            continue;
        }
        for i in 1..=n {
            let s = state.wrapping_add(GAMMA.wrapping_mul(2 * i));
            out.push(token_of(mix(s), mix(s.wrapping_add(GAMMA))));
        }
    }
    out
}

#[test]
fn the_prediction_recovers_a_splitmix_sequence() {
    // The check below cannot pass vacuously: from tokens that do come from SplitMix64, it
    // predicts the next ones.
    let state = 0x1234_5678_9abc_def0u64;
    let tokens: Vec<LockToken> = (0..4u64)
        .map(|i| {
            let s = state.wrapping_add(GAMMA.wrapping_mul(2 * i + 1));
            token_of(mix(s), mix(s.wrapping_add(GAMMA)))
        })
        .collect();
    assert_eq!(predicted_after(tokens[0], 3), tokens[1..]);
}

#[tokio::test]
async fn one_lock_token_does_not_predict_the_next_ones() {
    let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
    broker.create_queue("q", QueueProperties::default()).await.unwrap();
    for i in 0..20 {
        broker.send("q", Message::new("x").with_message_id(format!("m{i}"))).await.unwrap();
    }
    let got = broker.receive("q", 20, NOW).await.unwrap();
    let tokens: Vec<LockToken> = got.iter().map(|m| m.lock_token.unwrap()).collect();
    assert_eq!(tokens.len(), 20);
    for t in &tokens {
        assert_eq!(t.as_uuid().get_version_num(), 4, "{t:?} is not a version-4 UUID");
    }
    let predicted = predicted_after(tokens[0], 64);
    let guessed: Vec<_> = tokens[1..].iter().filter(|t| predicted.contains(t)).collect();
    assert!(
        guessed.is_empty(),
        "{} of 19 later tokens were predicted from the first",
        guessed.len()
    );
    broker.shutdown().await;
}

fn lost<T>(r: Result<T, Error>) -> bool {
    matches!(r, Err(Error::MessageLockLost))
}

#[tokio::test]
async fn a_lock_token_settles_nothing_outside_its_entity() {
    let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
    for q in ["a", "b"] {
        broker.create_queue(q, QueueProperties::default()).await.unwrap();
        broker.send(q, Message::new(q).with_message_id(q)).await.unwrap();
    }
    let token = broker.receive("a", 1, NOW).await.unwrap()[0].lock_token.unwrap();
    // A receiver of `b`, or of `a`'s dead-letter queue, holding `a`'s token, can do nothing
    // with it.
    for other in ["b", "a/$DeadLetterQueue"] {
        assert!(lost(broker.complete_in(other, &[token]).await), "complete on {other}");
        assert!(lost(broker.abandon_in(other, token, Properties::new()).await));
        let why = DeadLetterReason::new("stolen", "");
        assert!(lost(broker.dead_letter_in(other, token, why, Properties::new()).await));
        assert!(lost(broker.defer_in(other, token, Properties::new()).await));
        assert!(lost(broker.release_in(other, token).await));
        assert!(lost(broker.renew_lock_in(other, token).await));
    }
    // The message is still locked, with its first delivery, in `a`.
    let counts = broker.counts("a").await.unwrap();
    assert_eq!((counts.active, counts.dead_letter), (1, 0));
    assert!(broker.receive("a", 1, NOW).await.unwrap().is_empty());
    // A receiver of `a` settles it.
    broker.renew_lock_in("a", token).await.unwrap();
    broker.complete_in("A", &[token]).await.unwrap();
    assert_eq!(broker.counts("a").await.unwrap().active, 0);
    broker.shutdown().await;
}
