//! A property test over the frame decoder: arbitrary bytes (and arbitrary mutations of valid
//! frames) yield frames or typed errors, never a panic. It runs a bounded number of cases in
//! every test run.

use proptest::prelude::*;
use twice_servicebus::codec;
use twice_servicebus::frame::FrameReader;
use twice_servicebus::mapping::Sections;
use twice_servicebus::performative::{Flow, Performative, Transfer};

fn decode_all(bytes: &[u8]) {
    let _ = codec::decode(bytes);
    let _ = Performative::decode(bytes);
    let _ = Sections::parse(bytes);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    rt.block_on(async {
        let mut r = FrameReader::new(bytes, 4096);
        for _ in 0..64 {
            match r.read_frame().await {
                Ok(f) => {
                    let _ = Performative::decode(&f.body);
                }
                Err(_) => break,
            }
        }
    });
}

fn valid_frames() -> Vec<u8> {
    let mut out = Vec::new();
    let flow = Flow {
        incoming_window: 5,
        next_outgoing_id: 1,
        outgoing_window: 5,
        handle: Some(1),
        link_credit: Some(10),
        ..Flow::default()
    };
    twice_servicebus::frame::write_frame(&mut out, 0, 0, &Performative::Flow(flow), &[]);
    let t = Transfer {
        handle: 1,
        delivery_id: Some(0),
        delivery_tag: Some(bytes::Bytes::from_static(b"t")),
        ..Transfer::default()
    };
    let payload = twice_servicebus::mapping::encode_message(
        &twice::Message::new("body").with_message_id("m"),
    );
    twice_servicebus::frame::write_frame(&mut out, 0, 0, &Performative::Transfer(t), &payload);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
        let mut bytes = valid_frames();
        for (at, b) in flips {
            let i = at % bytes.len();
            bytes[i] = b;
        }
        let cut = cut % (bytes.len() + 1);
        decode_all(&bytes[..cut]);
        decode_all(&bytes);
    }
}
