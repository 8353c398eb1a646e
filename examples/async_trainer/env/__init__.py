"""The environments: the tasks and their rewards, the shared vocabulary, and ToRA's tool with
its sandbox (what runs a policy's untrusted code)."""
