//! A delivery reassembled from its transfer frames (AMQP 1.0 section 2.6.14), the same way on
//! both sides: the first frame opens it with its id, tag, format and settlement; every frame
//! adds its payload, until one without `more` ends it, or one with `aborted` drops it.

use bytes::{Bytes, BytesMut};

use crate::performative::Transfer;

/// A delivery whose frames are coming in.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Partial {
    /// The delivery id (the first frame's, or a later frame's that names one).
    pub delivery_id: u32,
    /// The delivery tag of the first frame.
    pub tag: Bytes,
    /// The message format of the first frame.
    pub format: u32,
    /// Whether the sender settled it (on any frame).
    pub settled: bool,
    /// The payload so far; emptied once it passed the size limit.
    pub payload: BytesMut,
    /// Whether the payload passed the size limit: the rest is not kept.
    pub oversize: bool,
}

/// What a frame did to its delivery.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// More frames follow.
    More,
    /// The sender aborted the delivery: nothing it carried is used.
    Aborted,
    /// The delivery is whole (or, if `oversize`, was too large to keep).
    Done(Partial),
}

/// Adds a transfer frame to the delivery in `slot`, which the frame opens if it is empty,
/// keeping at most `max_size` bytes of payload.
pub fn reassemble(
    slot: &mut Option<Partial>,
    t: &Transfer,
    payload: &[u8],
    max_size: usize,
) -> Step {
    let partial = slot.get_or_insert_with(|| Partial {
        delivery_id: t.delivery_id.unwrap_or(0),
        tag: t.delivery_tag.clone().unwrap_or_default(),
        format: t.message_format.unwrap_or(0),
        settled: t.settled.unwrap_or(false),
        ..Partial::default()
    });
    if let Some(id) = t.delivery_id {
        partial.delivery_id = id;
    }
    if t.settled == Some(true) {
        partial.settled = true;
    }
    if partial.payload.len().saturating_add(payload.len()) > max_size {
        partial.oversize = true;
        partial.payload = BytesMut::new();
    } else if !partial.oversize {
        partial.payload.extend_from_slice(payload);
    }
    if t.more && !t.aborted {
        return Step::More;
    }
    let done = slot.take().unwrap_or_default();
    if t.aborted { Step::Aborted } else { Step::Done(done) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(id: Option<u32>, more: bool) -> Transfer {
        Transfer {
            delivery_id: id,
            delivery_tag: id.map(|_| Bytes::from_static(b"t")),
            message_format: id.map(|_| 7),
            more,
            ..Transfer::default()
        }
    }

    #[test]
    fn frames_make_one_delivery() {
        let mut slot = None;
        assert_eq!(reassemble(&mut slot, &frame(Some(4), true), b"ab", 10), Step::More);
        let mut last = frame(None, false);
        last.settled = Some(true);
        let Step::Done(d) = reassemble(&mut slot, &last, b"cd", 10) else { panic!("not done") };
        assert_eq!((d.delivery_id, d.format, d.settled), (4, 7, true));
        assert_eq!((&d.tag[..], &d.payload[..], d.oversize), (&b"t"[..], &b"abcd"[..], false));
        assert!(slot.is_none());
    }

    #[test]
    fn an_oversize_delivery_keeps_nothing_and_an_aborted_one_is_dropped() {
        let mut slot = None;
        assert_eq!(reassemble(&mut slot, &frame(Some(1), true), b"abc", 4), Step::More);
        let Step::Done(d) = reassemble(&mut slot, &frame(None, false), b"de", 4) else {
            panic!("not done")
        };
        assert!(d.oversize && d.payload.is_empty());
        assert_eq!(reassemble(&mut slot, &frame(Some(2), true), b"a", 4), Step::More);
        let mut abort = frame(None, false);
        abort.aborted = true;
        assert_eq!(reassemble(&mut slot, &abort, b"", 4), Step::Aborted);
        assert!(slot.is_none());
    }
}
