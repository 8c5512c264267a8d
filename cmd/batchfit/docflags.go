package main

import "flag"

// docFlagSets are the flag sets of every subcommand, by name, as
// docs/cli.md describes them (TestCLIDocListsEveryFlag holds the two
// alike).
func docFlagSets() map[string]*flag.FlagSet {
	estimate, _ := estimateFlags()
	snapshot, _ := snapshotFlags()
	report, _ := reportFlags()
	compare, _ := compareFlags()
	calibrate, _ := calibrateFlags()
	return map[string]*flag.FlagSet{
		"estimate": estimate, "snapshot": snapshot, "report": report, "compare": compare,
		"calibrate": calibrate, "launch": launchFlags(&launchConfig{}),
		"models": flag.NewFlagSet("models", flag.ContinueOnError),
	}
}
