"""What both ends of the agent link share: the protocol's messages, the engine environment rules, weights on a node's disk and what their headers say."""
