package dist_test

// budgetForChunks is a budget in which rank 1's shard of
// TestGradientsEqualWholeBatch (80 rows) runs in 2 chunks on the CPU's
// simulated device; the whole shard needs 22 MiB reserved.
const budgetForChunks = 4 << 20
