"""What a task body uses: ``self.fence``, fenced blocks and sessions, staged effects and their
delivery."""
