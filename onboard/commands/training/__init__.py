"""What `onboard train` decides before it trains: the run config file, the run folder, and what a resume may change."""
