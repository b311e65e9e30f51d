"""A trained run used outside training: predict on images, export a SavedModel."""
