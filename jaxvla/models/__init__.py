"""Policies: the policy contract, the flow VLA network, samplers and tokenizers."""
