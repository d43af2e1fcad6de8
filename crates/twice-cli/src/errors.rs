//! How the CLI words its errors: one line, every cause once, and for a port that cannot be
//! bound, the flag that chooses another.

use std::net::SocketAddr;

/// The error and its causes on one line, `outer: cause: cause`, each cause once: a cause whose
/// text the line already holds (a library error that prints its source in its own message,
/// then names it again as its source) is left out.
pub(crate) fn render(e: &anyhow::Error) -> String {
    render_chain(e.chain())
}

/// [`render`] over any chain of errors, outermost first.
pub(crate) fn render_chain<'a>(
    chain: impl IntoIterator<Item = &'a (dyn std::error::Error + 'static)>,
) -> String {
    let mut line = String::new();
    for cause in chain {
        let text = cause.to_string();
        let text = text.trim();
        if text.is_empty() || line.contains(text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(text);
    }
    line
}

/// An I/O error's text without the `(os error N)` the standard library adds.
pub(crate) fn io_cause(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_owned(),
        _ => text,
    }
}

/// A listen address that cannot be bound, as one line naming the flag that sets it.
pub(crate) fn bind_error(flag: &str, addr: SocketAddr, e: &std::io::Error) -> anyhow::Error {
    let cause = io_cause(e);
    if e.kind() == std::io::ErrorKind::AddrInUse {
        anyhow::anyhow!("{flag} {addr} is in use ({cause}); choose another port with {flag}")
    } else {
        anyhow::anyhow!(
            "{flag} {addr} cannot be bound ({cause}); choose another address with {flag}"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that prints its source in its own message, as many libraries' errors do.
    #[derive(Debug, thiserror::Error)]
    #[error("cannot listen on 127.0.0.1:1: {source}")]
    struct Repeats {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn every_cause_is_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use");
        let e = anyhow::Error::new(Repeats { source: io }).context("starting the server");
        assert_eq!(
            render(&e),
            "starting the server: cannot listen on 127.0.0.1:1: Address already in use"
        );
        // A context that already quotes its cause.
        let inner = anyhow::anyhow!("no such file");
        let e = inner.context("reading x.json: no such file");
        assert_eq!(render(&e), "reading x.json: no such file");
        // Distinct causes all stay, in order.
        let e = anyhow::anyhow!("c").context("b").context("a");
        assert_eq!(render(&e), "a: b: c");
    }

    #[test]
    fn a_port_in_use_names_its_flag_and_its_cause_once() {
        let addr: SocketAddr = "127.0.0.1:5673".parse().unwrap();
        let e = std::io::Error::from_raw_os_error(98);
        assert_eq!(
            bind_error("--amqp", addr, &e).to_string(),
            "--amqp 127.0.0.1:5673 is in use (Address already in use); choose another port with --amqp"
        );
    }
}
