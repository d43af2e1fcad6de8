//! Getting in: the protocol headers, SASL, `open`, the answer to a connection over the limit,
//! and the `$cbs` tokens that authorize links, with what they allow.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use crate::address::{self, Node};
use crate::backend::Backend;
use crate::conditions::{self as cond, token_expired};
use crate::frame::{self, Frame, FrameReader};
use crate::grants::{audience_is_ours, same_secret, server_ports};
use crate::mgmt;
use crate::performative::{AmqpError, Open, Performative};
use crate::sas::{Claim, Claims};
use crate::shared::Shared;
use twice_amqp::servicebus::StatusKeys;

use super::state::{max_channel, need_of};
use super::{Conn, End};

/// Answers a connection over the limit whose first frame was `open`: `open` and a `close`
/// with `amqp:resource-limit-exceeded`.
///
/// # Cancel safety
///
/// Dropping the future drops the connection.
pub(super) async fn refuse<B: Backend, W: AsyncWrite + Unpin>(
    first: &Frame,
    wr: &mut W,
    shared: &Shared<B>,
) {
    if !matches!(Performative::decode(&first.body), Ok((Performative::Open(_), _))) {
        return;
    }
    let error = AmqpError::new(
        cond::RESOURCE_LIMIT,
        format!("the server serves at most {} connections", shared.options.max_connections),
    );
    let mut out = Vec::new();
    let open = Open { container_id: "twice".into(), max_frame_size: 65536, ..Open::default() };
    frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
    frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Close(Some(error)), &[]);
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        wr.write_all(&out).await?;
        wr.shutdown().await
    })
    .await;
}

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// Protocol headers and SASL. Returns the claims of the configured key SASL PLAIN
/// authenticated with, if it did.
pub(super) async fn handshake<B: Backend, R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    reader: &mut FrameReader<R>,
    wr: &mut W,
    shared: &Shared<B>,
) -> Result<Option<Claims>, ()> {
    let mut header = reader.read_protocol_header().await.map_err(|_| ())?;
    let mut plain_ok = None;
    if header == frame::SASL_HEADER {
        let mut out = frame::SASL_HEADER.to_vec();
        let mechs = Performative::SaslMechanisms(vec![
            "MSSBCBS".into(),
            "ANONYMOUS".into(),
            "PLAIN".into(),
        ]);
        frame::write_frame(&mut out, frame::TYPE_SASL, 0, &mechs, &[]);
        wr.write_all(&out).await.map_err(|_| ())?;
        let f = reader.read_frame().await.map_err(|_| ())?;
        let init = match Performative::decode(&f.body) {
            Ok((Performative::SaslInit(i), _)) if f.kind == frame::TYPE_SASL => i,
            _ => return Err(()),
        };
        let code = match init.mechanism.as_str() {
            "ANONYMOUS" | "MSSBCBS" => 0,
            "PLAIN" => {
                let resp = init.initial_response.unwrap_or_default();
                let mut parts = resp.split(|b| *b == 0);
                let _authzid = parts.next();
                let user = parts.next().and_then(|u| std::str::from_utf8(u).ok());
                let pass = parts.next().and_then(|p| std::str::from_utf8(p).ok());
                match (user, pass) {
                    (Some(u), Some(p))
                        if shared
                            .options
                            .keys
                            .get(u)
                            .is_some_and(|k| same_secret(k.as_bytes(), p.as_bytes())) =>
                    {
                        plain_ok = Some(shared.options.keys.claims(u));
                        0
                    }
                    _ => 1,
                }
            }
            _ => 1,
        };
        let mut out = Vec::new();
        frame::write_frame(&mut out, frame::TYPE_SASL, 0, &Performative::SaslOutcome(code), &[]);
        wr.write_all(&out).await.map_err(|_| ())?;
        if code != 0 {
            tracing::debug!(mechanism = %init.mechanism, "sasl authentication failed");
            return Err(());
        }
        header = reader.read_protocol_header().await.map_err(|_| ())?;
    }
    if header != frame::AMQP_HEADER {
        if header[0] == TLS_HANDSHAKE
            && shared.options.tls.is_none()
            && crate::hint::AMQPS_ON_PLAIN_AMQP.due(shared.options.clock.now())
        {
            tracing::warn!(
                "an amqps (TLS) client reached the plain AMQP port: add UseDevelopmentEmulator=true; to its connection string, or give the server a certificate (twice serve: --tls-cert)"
            );
        }
        // The specification's answer to an unsupported header: ours, then close.
        let _ = wr.write_all(&frame::AMQP_HEADER).await;
        return Err(());
    }
    wr.write_all(&frame::AMQP_HEADER).await.map_err(|_| ())?;
    Ok(plain_ok)
}

impl<B: Backend> Conn<B> {
    pub(super) fn on_open(&mut self, f: &Frame) -> Result<(Duration, u32), End> {
        let open = match Performative::decode(&f.body) {
            Ok((Performative::Open(o), _)) if f.kind == frame::TYPE_AMQP => o,
            Ok(_) => {
                return Err(End::Close(Some(AmqpError::new(cond::NOT_ALLOWED, "expected open"))));
            }
            Err(e) => {
                return Err(End::Close(Some(AmqpError::new(cond::DECODE_ERROR, e.to_string()))));
            }
        };
        self.out.peer_max_frame = open.max_frame_size.max(frame::MIN_MAX_FRAME_SIZE);
        self.channel_max = open.channel_max;
        let opts = &self.shared.options;
        let idle_ms = u32::try_from(opts.idle_timeout.as_millis()).unwrap_or(u32::MAX);
        self.out.send(
            0,
            &Performative::Open(Open {
                container_id: "twice".into(),
                hostname: None,
                max_frame_size: opts.max_frame_size,
                channel_max: max_channel(opts.max_sessions_per_connection),
                idle_time_out: (idle_ms > 0).then_some(idle_ms),
                properties: None,
            }),
        );
        // Heartbeat at half the peer's idle timeout (at most every 10 s); drop a peer silent
        // for twice ours.
        let peer_idle = open
            .idle_time_out
            .filter(|ms| *ms > 0)
            .map(|ms| Duration::from_millis(u64::from(ms) / 2));
        let beat = peer_idle
            .unwrap_or(Duration::from_secs(10))
            .clamp(Duration::from_millis(100), Duration::from_secs(10));
        let ticks = if opts.idle_timeout.is_zero() {
            u32::MAX
        } else {
            let n = (opts.idle_timeout * 2).as_millis() / beat.as_millis().max(1);
            u32::try_from(n).unwrap_or(u32::MAX).max(2)
        };
        Ok((beat, ticks))
    }

    pub(super) fn authorized(&self, path: &str, need: Option<Claim>) -> bool {
        self.grants.allows(path, self.shared.options.clock.now().as_millis() / 1000, need)
    }

    pub(super) fn on_cbs(&mut self, payload: &[u8]) -> Option<mgmt::Reply> {
        let now = self.shared.options.clock.now().as_millis() / 1000;
        let req = mgmt::Request::parse(payload).ok()?;
        let (status, description) = if req.operation() == Some("put-token") {
            let token = req.body.as_str().unwrap_or("");
            let opts = &self.shared.options;
            match opts.keys.validate(token, now) {
                Ok(grant)
                    if !audience_is_ours(
                        &grant.resource,
                        &opts.hostname,
                        opts.amqp_addr,
                        &server_ports(opts, opts.amqp_addr),
                    ) =>
                {
                    tracing::debug!("token refused: its audience names another host");
                    (401, "Unauthorized: the token's audience is not this namespace".to_owned())
                }
                Ok(grant) => {
                    let path = address::normalize(&grant.resource);
                    let claims = opts.keys.claims(&grant.key_name);
                    if self.grants.insert(path, grant.expiry, claims, now) {
                        (202, "Accepted".to_owned())
                    } else {
                        (403, "Forbidden: too many tokens on one connection".to_owned())
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "token refused");
                    (401, format!("Unauthorized: {e}"))
                }
            }
        } else {
            (400, "unknown operation".to_owned())
        };
        let mut reply = mgmt::Reply::to_request(&req, status, description);
        reply.keys = StatusKeys::Cbs;
        if status == 401 {
            reply.condition = Some(cond::UNAUTHORIZED.to_owned());
        }
        Some(reply)
    }

    /// Detaches the links whose token has expired (and was not renewed), as Service Bus does.
    pub(super) fn detach_unauthorized(&mut self) {
        let mut expired = Vec::new();
        for (ch, s) in &self.sessions {
            for (handle, l) in &s.links {
                if l.attached
                    && !l.detached
                    && l.node != Node::Cbs
                    && !self.authorized(&l.path, need_of(l))
                {
                    expired.push((*ch, *handle, l.path.clone()));
                }
            }
        }
        for (ch, handle, path) in expired {
            self.detach_with(ch, handle, token_expired(&path));
        }
    }
}
