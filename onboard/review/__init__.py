"""What follows alignment: PR.md, the text a person reviews, and the retreat to the release's own
modules where alignment failed (demote)."""
