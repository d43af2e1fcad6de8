use super::*;

fn opts(segment_size: u64, cache_bytes: usize) -> LogOptions {
    LogOptions { segment_size, cache_bytes, ..LogOptions::default() }
}

fn payload(i: usize) -> Bytes {
    // Varied sizes and contents, so that cuts and flips land in every kind of byte.
    let n = 1 + (i * 37) % 300;
    Bytes::from((0..n).map(|j| u8::try_from((i * 31 + j * 7) % 251).unwrap()).collect::<Vec<_>>())
}

fn replay_all(replay: Replay) -> Result<Vec<(Location, Bytes)>, StorageError> {
    replay.map(|r| r.map(|r| (r.location, r.payload))).collect()
}

fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format::segment_file_name(id))
}

/// Writes `n` records into a fresh log in `dir`, each in a commit of its own made durable
/// before the next, and returns their locations.
fn write_records(dir: &Path, n: usize, options: LogOptions) -> Vec<Location> {
    let (mut log, replay) = Log::open(dir, options).unwrap();
    assert!(replay_all(replay).unwrap().is_empty());
    let mut locs = Vec::new();
    for i in 0..n {
        if log.should_roll() {
            log.roll();
        }
        locs.push(log.append(payload(i)).unwrap());
        log.flush_blocking().unwrap();
    }
    log.close().unwrap();
    locs
}

#[test]
fn records_survive_reopen_across_segments() {
    let dir = tempfile::tempdir().unwrap();
    let locs = write_records(dir.path(), 500, opts(4096, 1 << 20));
    assert!(locs.last().unwrap().segment > 5, "the small segment size makes the log roll");
    let (log, replay) = Log::open(dir.path(), opts(4096, 0)).unwrap();
    let got = replay_all(replay).unwrap();
    assert_eq!(got.len(), 500);
    for (i, (loc, bytes)) in got.iter().enumerate() {
        assert_eq!(*loc, locs[i]);
        assert_eq!(*bytes, payload(i));
        // With no cache every read is a checked pread.
        assert_eq!(log.read(*loc).unwrap(), payload(i));
    }
}

#[test]
fn reads_come_from_cache_then_disk() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), opts(1 << 20, 1000)).unwrap();
    let mut locs = Vec::new();
    for i in 0..200 {
        locs.push(log.append(payload(i)).unwrap());
        // Uncommitted records are readable: they must stay cached until written.
        assert_eq!(log.read(locs[i]).unwrap(), payload(i));
        if i % 10 == 9 {
            log.flush_blocking().unwrap();
        }
    }
    // Only the last ten records (not yet written) may push the cache over its bound.
    assert!(log.cache.bytes <= 1000 + 10 * 300, "the cache stays near its bound");
    for (i, loc) in locs.iter().enumerate() {
        assert_eq!(log.read(*loc).unwrap(), payload(i));
    }
}

#[test]
fn a_damaged_record_read_from_disk_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), opts(1 << 20, 0)).unwrap();
    let loc = log.append(Bytes::from_static(b"precious")).unwrap();
    log.flush_blocking().unwrap();
    // The next append pushes the written record out of the (zero-sized) cache.
    log.append(Bytes::from_static(b"next")).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(segment_path(dir.path(), 1)).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"X", loc.offset + 10).unwrap();
    assert!(
        matches!(log.read(loc), Err(StorageError::Corrupt { segment: 1, offset }) if offset == loc.offset)
    );
}

/// Reading many records gives what reading each gives: records close together in a segment
/// (read with one read), far apart, out of order, in other segments, cached or not, repeated;
/// and a damaged record in a run is the same error.
#[test]
fn reading_many_records_reads_each() {
    let dir = tempfile::tempdir().unwrap();
    let locs = write_records(dir.path(), 600, opts(16 << 10, 0));
    assert!(locs.last().unwrap().segment > 2, "the log rolls");
    let (mut log, replay) = Log::open(dir.path(), opts(16 << 10, 2000)).unwrap();
    replay_all(replay).unwrap();
    // A few recent records in the cache.
    let mut cached = Vec::new();
    for i in 600..610 {
        cached.push(log.append(payload(i)).unwrap());
    }
    let mut picks: Vec<Location> = locs[10..300].to_vec();
    picks.extend([locs[5], locs[5], locs[400], cached[0], locs[401], cached[9], locs[599]]);
    picks.extend(locs.iter().step_by(97).copied());
    picks.extend(locs[300..600].iter().rev().copied());
    let want: Vec<Bytes> = picks.iter().map(|l| log.read(*l).unwrap()).collect();
    assert_eq!(log.read_many(&picks).unwrap(), want);
    assert!(log.read_many(&[]).unwrap().is_empty());

    let damaged = locs[20];
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(segment_path(dir.path(), damaged.segment))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"X", damaged.offset + 9).unwrap();
    let corrupt = |e: StorageError| matches!(e, StorageError::Corrupt { segment, offset } if segment == damaged.segment && offset == damaged.offset);
    assert!(corrupt(log.read(damaged).unwrap_err()));
    assert!(corrupt(log.read_many(&locs[10..30]).unwrap_err()));
    assert_eq!(log.read_many(&locs[21..30]).unwrap(), &want[11..20]);
}

#[test]
fn torn_tail_at_every_byte_offset_is_truncated() {
    let src = tempfile::tempdir().unwrap();
    let locs = write_records(src.path(), 6, LogOptions::default());
    let full = std::fs::read(segment_path(src.path(), 1)).unwrap();
    let ends: Vec<u64> = locs.iter().map(|l| l.offset + FRAME_LEN + u64::from(l.len)).collect();
    for cut in 0..full.len() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(segment_path(dir.path(), 1), &full[..cut]).unwrap();
        let (mut log, replay) = Log::open(dir.path(), LogOptions::default())
            .unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        let got = replay_all(replay).unwrap();
        let cut64 = u64::try_from(cut).unwrap();
        let intact = ends.iter().filter(|&&e| e <= cut64).count();
        assert_eq!(got.len(), intact, "cut at {cut}");
        for (i, (loc, bytes)) in got.iter().enumerate() {
            assert_eq!((*loc, bytes), (locs[i], &payload(i)), "cut at {cut}");
        }
        let valid = if intact == 0 { HEADER_LEN } else { ends[intact - 1] };
        let len = std::fs::metadata(segment_path(dir.path(), 1)).unwrap().len();
        assert_eq!(len, valid, "cut at {cut}: the torn tail is truncated");
        // The repaired log takes new records after the intact ones.
        let loc = log.append(Bytes::from_static(b"after")).unwrap();
        assert_eq!(loc.offset, valid + BLOCK_LEN);
        log.close().unwrap();
        let (_, replay) = Log::open(dir.path(), LogOptions::default()).unwrap();
        assert_eq!(replay_all(replay).unwrap().len(), intact + 1, "cut at {cut}");
    }
}

#[test]
fn bit_flips_are_caught_never_skipped() {
    let src = tempfile::tempdir().unwrap();
    let locs = write_records(src.path(), 5, LogOptions::default());
    let full = std::fs::read(segment_path(src.path(), 1)).unwrap();
    let last = *locs.last().unwrap();
    for byte in 0..full.len() {
        for bit in [0, 3, 7] {
            let mut data = full.clone();
            data[byte] ^= 1 << bit;
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(segment_path(dir.path(), 1), &data).unwrap();
            let byte64 = u64::try_from(byte).unwrap();
            let outcome = Log::open(dir.path(), LogOptions::default()).map(|(_, r)| replay_all(r));
            if byte64 < HEADER_LEN {
                assert!(
                    matches!(
                        outcome,
                        Err(StorageError::Corrupt { segment: 1, offset: 0 }
                            | StorageError::UnsupportedVersion { .. })
                    ),
                    "flip {byte}.{bit}: {outcome:?}"
                );
            } else if byte64 >= last.offset - BLOCK_LEN {
                // The newest commit with nothing after it: an unacknowledged torn write.
                let got = outcome.unwrap().unwrap();
                assert_eq!(got.len(), locs.len() - 1, "flip {byte}.{bit}");
            } else {
                // A later commit was written when this one was durable: it is damage.
                let rec = locs.iter().rev().find(|l| l.offset - BLOCK_LEN <= byte64).unwrap();
                let at = if byte64 < rec.offset { rec.offset - BLOCK_LEN } else { rec.offset };
                assert!(
                    matches!(outcome, Err(StorageError::Corrupt { segment: 1, offset }) if offset == at),
                    "flip {byte}.{bit}: {outcome:?}"
                );
            }
        }
    }
}

#[test]
fn damage_in_an_older_segment_fails_replay() {
    let dir = tempfile::tempdir().unwrap();
    let locs = write_records(dir.path(), 100, opts(2048, 0));
    let victim = locs.iter().find(|l| l.segment == 2).copied().unwrap();
    // Cut the older segment short: not the newest one, so it is corruption, not a torn tail.
    let path = segment_path(dir.path(), 2);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(victim.offset + 3).unwrap();
    let (_, replay) = Log::open(dir.path(), opts(2048, 0)).unwrap();
    let err = replay_all(replay).unwrap_err();
    assert!(
        matches!(err, StorageError::Corrupt { segment: 2, offset } if offset == victim.offset),
        "{err:?}"
    );
}

#[test]
fn commits_queued_behind_a_busy_writer_share_one_fsync() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), LogOptions::default()).unwrap();
    log.append(payload(0)).unwrap();
    log.flush_blocking().unwrap();
    let before = log.fsyncs();
    let gate = log.shared.clone();
    let held = gate.gate.lock().unwrap();
    let mut last = 0;
    for i in 0..100 {
        log.append(payload(i)).unwrap();
        last = log.commit().unwrap();
    }
    drop(held);
    log.durable().wait_blocking(last).unwrap();
    assert_eq!(log.fsyncs() - before, 1, "100 commits, one fsync");

    // Without the gate, commits still batch whenever the writer is busy.
    let before = log.fsyncs();
    for i in 0..2000 {
        log.append(payload(i)).unwrap();
        last = log.commit().unwrap();
    }
    log.durable().wait_blocking(last).unwrap();
    assert!(log.fsyncs() - before <= 2000);
}

#[tokio::test]
async fn async_waiters_see_durability() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), LogOptions::default()).unwrap();
    let mut durable = log.durable();
    log.append(payload(1)).unwrap();
    let seq = log.commit().unwrap();
    durable.wait(seq).await.unwrap();
    assert!(durable.current().unwrap() >= seq);
}

#[test]
fn a_data_directory_opens_once() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = Log::open(dir.path(), LogOptions::default()).unwrap();
    assert!(matches!(Log::open(dir.path(), LogOptions::default()), Err(StorageError::Locked(_))));
    drop(log);
    Log::open(dir.path(), LogOptions::default()).unwrap();
}

#[test]
fn removed_segments_are_gone_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), opts(1024, 1 << 20)).unwrap();
    let a = log.append(payload(1)).unwrap();
    log.roll();
    let b = log.append(payload(2)).unwrap();
    assert!(matches!(log.remove_segment(2), Err(StorageError::NotFound { .. })), "active");
    log.remove_segment(1).unwrap();
    assert!(matches!(log.read(a), Err(StorageError::NotFound { .. })));
    assert_eq!(log.read(b).unwrap(), payload(2));
    log.close().unwrap();
    assert!(!segment_path(dir.path(), 1).exists());
    let (_, replay) = Log::open(dir.path(), opts(1024, 0)).unwrap();
    assert_eq!(replay_all(replay).unwrap(), vec![(b, payload(2))]);
}

#[test]
fn oversized_records_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), LogOptions::default()).unwrap();
    let big = Bytes::from(vec![0u8; usize::try_from(MAX_RECORD_LEN).unwrap() + 1]);
    assert!(matches!(log.append(big), Err(StorageError::RecordTooLarge { .. })));
}

#[test]
fn records_encoded_in_place_span_blocks_and_a_failed_encoding_leaves_no_trace() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), opts(64 << 20, 0)).unwrap();
    let mut locs = Vec::new();
    // Enough large records to need several arena blocks, with a commit now and then so that
    // frames of one block go to the writer in different commits.
    for i in 0..600 {
        let body = vec![u8::try_from(i % 251).unwrap(); 1000 + i];
        let loc = log
            .append_with(16, |buf| {
                buf.extend_from_slice(&body);
                Ok(())
            })
            .unwrap();
        locs.push((loc, body));
        if i % 50 == 0 {
            log.commit().unwrap();
        }
        if i % 100 == 7 {
            let err = log
                .append_with(16, |buf| {
                    buf.extend_from_slice(b"half a record");
                    Err("no".to_owned())
                })
                .unwrap_err();
            assert!(matches!(err, StorageError::Encode(_)));
        }
    }
    log.close().unwrap();
    let (log, replay) = Log::open(dir.path(), opts(64 << 20, 0)).unwrap();
    let got = replay_all(replay).unwrap();
    assert_eq!(got.len(), locs.len());
    for ((loc, bytes), (want_loc, body)) in got.iter().zip(&locs) {
        assert_eq!(loc, want_loc);
        assert_eq!(bytes.as_ref(), body.as_slice());
        assert_eq!(log.read(*loc).unwrap().as_ref(), body.as_slice());
    }
}

#[test]
fn a_missing_middle_segment_is_refused_with_its_id() {
    let dir = tempfile::tempdir().unwrap();
    let locs = write_records(dir.path(), 200, opts(2048, 0));
    assert!(locs.last().unwrap().segment >= 4);
    std::fs::remove_file(segment_path(dir.path(), 3)).unwrap();
    let err = Log::open(dir.path(), opts(2048, 0)).map(|(_, r)| replay_all(r).map(|v| v.len()));
    assert!(
        matches!(err, Err(StorageError::MissingSegment { segment: 3, before: 2, after: 4 })),
        "{err:?}"
    );
    // Removing the oldest segments (as compaction does) leaves a log that opens.
    std::fs::remove_file(segment_path(dir.path(), 1)).unwrap();
    std::fs::remove_file(segment_path(dir.path(), 2)).unwrap();
    let (_, replay) = Log::open(dir.path(), opts(2048, 0)).unwrap();
    let got = replay_all(replay).unwrap();
    assert_eq!(got.first().unwrap().0.segment, 4);
}

/// A frame as a client could build it without access to the disk: length, CRC-32 of the length
/// and payload, payload.
fn forged_frame(payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap();
    let mut h = crc32fast::Hasher::new();
    h.update(&len.to_le_bytes());
    h.update(payload);
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(&h.finalize().to_le_bytes());
    out.extend_from_slice(payload);
    out
}

#[test]
fn a_frame_forged_inside_a_torn_record_does_not_block_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(dir.path(), LogOptions::default()).unwrap();
    for i in 0..3 {
        log.append(payload(i)).unwrap();
    }
    log.flush_blocking().unwrap();
    // A message body that carries well-formed frames, as any client may send.
    let mut body = vec![0xAB; 100];
    for _ in 0..4 {
        body.extend_from_slice(&forged_frame(b"a record the log never wrote"));
        body.extend_from_slice(&[0xCD; 50]);
    }
    let victim = log.append(Bytes::from(body.clone())).unwrap();
    log.close().unwrap();
    let path = segment_path(dir.path(), 1);
    let full = std::fs::read(&path).unwrap();
    // A crash tears the record at every point after its first forged frame.
    let body_at = usize::try_from(victim.offset + FRAME_LEN).unwrap();
    for cut in (body_at + 150..full.len()).step_by(7) {
        std::fs::write(&path, &full[..cut]).unwrap();
        let (log, replay) = Log::open(dir.path(), LogOptions::default())
            .unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        let got = replay_all(replay).unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        assert_eq!(got.len(), 3, "cut at {cut}: the torn record is dropped, the others stay");
        drop(log);
    }
}
