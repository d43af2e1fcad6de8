//! Channel and handle numbers: the lowest never used, or one given back, in O(1).

/// A pool of numbers from 0 up: taking and giving back cost O(1), so a peer that opens and
/// closes sessions or links over and over costs constant work per frame.
#[derive(Debug, Default)]
pub(crate) struct IdPool {
    next: u32,
    free: Vec<u32>,
}

impl IdPool {
    /// A free number: one given back, else the next never used.
    pub(crate) fn take(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            let id = self.next;
            self.next = self.next.saturating_add(1);
            id
        })
    }

    /// Gives a number back for reuse.
    pub(crate) fn give_back(&mut self, id: u32) {
        self.free.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::IdPool;

    #[test]
    fn numbers_are_unique_until_given_back() {
        let mut pool = IdPool::default();
        assert_eq!((pool.take(), pool.take(), pool.take()), (0, 1, 2));
        pool.give_back(1);
        assert_eq!(pool.take(), 1);
        assert_eq!(pool.take(), 3);
    }
}
