"""The recovery half of a simulated replica (``sim_replica.Replica``): promotions and residual restores through the
one in-order H2D copy queue (``h2d_free_at``), their completion, and the next time an idle replica has something to
wake for. The state it reads and writes (pool, arbiter, running sequences, the queue's clock, events) is the
replica's own."""

from __future__ import annotations

from elastiserve.control.sim_sequence import PromotionInFlight


class TransferRecovery:
    def _recover(self) -> None:
        if not self.pool.evicted_layers() and not any(s.base_pairs for s in self.running):
            self.arbiter.idle_recovery(self.now)  # nothing degraded: only the reserve decays
            return
        decision = self.arbiter.decide_recovery(self.observe(None, 0, f_post=True))
        if decision.promote_pairs:
            self._start_promotions(decision.promote_pairs, decision.reasons)
        if decision.start_restore:
            layer = decision.restore_layers[0]
            self.pool.begin_restore(layer)
            start = max(self.now, self.h2d_free_at)
            self.h2d_free_at = start + self.pool.units_per_layer * self.sm.restore_per_unit_s
            self.restoring = (layer, self.h2d_free_at)
            self.events.add(self.now, self.step, "restore_start", 1, "; ".join(decision.reasons))

    def _start_promotions(self, n: int, reasons: tuple[str, ...]) -> None:
        # Most recently used sequences first: their BASE pairs are read again soonest.
        candidates = [(s, p) for s in sorted(self.running, key=lambda s: -s.last_used_step)
                      for p in sorted(s.base_pairs) if p not in s.promoting]
        started = 0
        for seq, pair in candidates[:n]:
            fresh = self.pool.alloc_blocks(2)
            if fresh is None:
                break
            start = max(self.now, self.h2d_free_at)
            self.h2d_free_at = start + self.sm.promote_copy_per_pair_s
            seq.promoting[pair] = PromotionInFlight(pair, fresh, self.h2d_free_at)
            self.promotions.append((self.h2d_free_at, seq, pair))
            started += 1
        if started:
            self.events.add(self.now, self.step, "promote_start", started, "; ".join(reasons))

    def _complete_transfers(self) -> int:
        """Publish promotions whose copy has landed (the coming step unpacks them) and commit a finished restore;
        returns the number of pairs published."""
        done = [p for p in self.promotions if p[0] <= self.now]
        if done:
            self.promotions = [p for p in self.promotions if p[0] > self.now]
            self.pool.free_blocks([seq.publish_promotion(pair) for _, seq, pair in done])
            self.events.add(self.now, self.step, "promote_done", len(done), "published")
        if self.restoring and self.restoring[1] <= self.now:
            self.pool.commit_restore(self.restoring[0])
            self.restoring = None
            self.events.add(self.now, self.step, "restore_done", 1, "residual copied back")
        self._note_mode()
        return len(done)

    def next_wakeup(self) -> float | None:
        """Earliest pending transfer completion, for an idle replica."""
        times = [p[0] for p in self.promotions] + ([self.restoring[1]] if self.restoring else [])
        return min(times) if times else None
