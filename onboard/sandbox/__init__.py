"""Run untrusted code (generated candidates, a release's own modeling code) in a confined process."""
