//! Who may use the console: the `Host` a request names, the origin of a POST, and the rights
//! of the token in `Authorization`.

use std::net::{IpAddr, SocketAddr};

use super::{ApiError, Request};
use crate::backend::Backend;
use crate::grants::{Grants, audience_is_ours, server_ports};
use crate::sas::Claim;
use crate::shared::Shared;

/// The host part of a `Host` header or an origin's authority: without port, brackets or
/// trailing dot, lowercase.
fn host_of(authority: &str) -> String {
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Checks that the request names this server: its host name, `localhost`, or an IP literal.
/// A page on another site that re-points its own name at this server (DNS rebinding) sends
/// its own name, and is refused.
pub(super) fn check_host<B>(shared: &Shared<B>, req: &Request<'_>) -> Result<(), ApiError> {
    let Some(raw) = req.header("host") else {
        return Err(ApiError::BadRequest("the request has no Host header".into()));
    };
    let host = host_of(raw);
    if host == "localhost"
        || host.eq_ignore_ascii_case(&shared.options.hostname)
        || host.parse::<IpAddr>().is_ok()
    {
        Ok(())
    } else {
        Err(ApiError::Forbidden(format!(
            "the console answers only to its host name (twice serve --hostname), localhost or an IP address, not '{host}'"
        )))
    }
}

/// Checks that a POST comes from the console's own origin and carries JSON.
///
/// A browser names the page that sent a request in `Origin` (and, when it supports it, says in
/// `Sec-Fetch-Site` whether that page is this site): one that names another origin is refused.
/// A client that is not a browser sends neither, and proves itself with its token alone.
pub(super) fn check_post(req: &Request<'_>) -> Result<(), ApiError> {
    if let Some(site) = req.header("sec-fetch-site")
        && !matches!(site, "same-origin" | "none")
    {
        return Err(ApiError::Forbidden(format!("a {site} request may not change anything")));
    }
    if let Some(origin) = req.header("origin") {
        let host = req.header("host").unwrap_or("");
        let authority = origin.split_once("://").map_or("", |(_, a)| a);
        if origin == "null" || !authority.eq_ignore_ascii_case(host) {
            return Err(ApiError::Forbidden(format!(
                "a request from the origin '{origin}' may not change anything here"
            )));
        }
    }
    let content_type = req.header("content-type").unwrap_or("");
    let media = content_type.split(';').next().unwrap_or("").trim();
    if !media.eq_ignore_ascii_case("application/json") {
        return Err(ApiError::UnsupportedMediaType(format!(
            "the body must be application/json, not '{content_type}'"
        )));
    }
    Ok(())
}

/// Whether reads of message bodies and properties need a token: not on a server with no key,
/// which has nothing to check one against.
pub(super) fn reads_need_token<B>(shared: &Shared<B>) -> bool {
    !shared.options.keys.is_empty()
}

/// Checks the `SharedAccessSignature` in `Authorization`: signed with a configured key, not
/// expired on the server's clock, for this host (when its resource names one), covering every
/// path in `paths`, and granting every claim in `need` on each (`Manage` grants all three).
///
/// A missing or invalid token is [`ApiError::Unauthorized`]; a valid one that does not grant
/// enough is [`ApiError::Forbidden`].
pub(super) fn authorize<B: Backend>(
    shared: &Shared<B>,
    addr: SocketAddr,
    req: &Request<'_>,
    paths: &[&str],
    need: &[Claim],
) -> Result<(), ApiError> {
    let (key_name, grants, now) = grants_of(shared, addr, req)?;
    for path in paths {
        for claim in need {
            if !grants.allows(path, now, Some(*claim)) {
                return Err(ApiError::Forbidden(format!(
                    "the token of '{key_name}' does not grant {claim:?} on '{path}'"
                )));
            }
        }
    }
    Ok(())
}

/// The name of the key that signed the request's token, when a configured key did: what the
/// page asks when it signs in, so that a wrong key is told at once. A missing or invalid token
/// is [`ApiError::Unauthorized`].
pub(super) fn key_name<B: Backend>(
    shared: &Shared<B>,
    addr: SocketAddr,
    req: &Request<'_>,
) -> Result<String, ApiError> {
    grants_of(shared, addr, req).map(|(key_name, _, _)| key_name)
}

/// The key name, grants and the server's time (in seconds) of the request's token.
fn grants_of<B: Backend>(
    shared: &Shared<B>,
    addr: SocketAddr,
    req: &Request<'_>,
) -> Result<(String, Grants, i64), ApiError> {
    let Some(token) = req.header("authorization") else {
        return Err(ApiError::Unauthorized(
            "this needs a SharedAccessSignature token in the Authorization header".into(),
        ));
    };
    let now = shared.options.clock.now().as_millis().div_euclid(1000);
    let opts = &shared.options;
    let grant =
        opts.keys.validate(token, now).map_err(|e| ApiError::Unauthorized(e.to_string()))?;
    if grant.resource.contains("://")
        && !audience_is_ours(&grant.resource, &opts.hostname, addr, &server_ports(opts, addr))
    {
        return Err(ApiError::Unauthorized("the token's audience is not this namespace".into()));
    }
    let resource = grant.resource.split('?').next().unwrap_or_default();
    let mut grants = Grants::default();
    grants.insert(
        crate::address::normalize(resource),
        grant.expiry,
        opts.keys.claims(&grant.key_name),
        now,
    );
    Ok((grant.key_name, grants, now))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_lose_their_port_and_brackets() {
        assert_eq!(host_of("127.0.0.1:5300"), "127.0.0.1");
        assert_eq!(host_of("[::1]:5300"), "::1");
        assert_eq!(host_of("LocalHost"), "localhost");
        assert_eq!(host_of("box.lan.:80"), "box.lan");
    }
}
